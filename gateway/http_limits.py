"""HTTP/1.1 limits before any request reaches the app (so before authentication): the headers'
total size and count, and a deadline for them. uvicorn's httptools protocol with three checks
added; `limited_http(settings)` is the protocol class `lockgate serve` runs.

- Size: the bytes read while a request's headers are incomplete are counted; past
  `max_header_bytes` the answer is 431 and the connection is closed (at most one read buffer
  over the limit is ever held: httptools would otherwise buffer a header of any size).
- Count: past `max_headers` headers, 431 and closed.
- Deadline: a request's headers must be complete `header_timeout_s` after the connection
  opened or the request's first byte, else 408 and closed (a deadline, not an idle timer, so
  a client dripping a byte at a time is closed too).

Then the body, as the app reads it (`BodyLimits`, ASGI middleware, so in process too):

- Size: a body without Content-Length is counted as it arrives; past its path's limit the
  answer is a readable 413 (`refuse_too_large`). A declared length over it is refused before
  the app runs (gateway/request_context.py).
- Deadline: the whole body must arrive within `body_read_timeout_s` of the app's first read,
  plus a second per `body_min_bytes_per_s` bytes received; else 408 and the connection
  closed. The app sees the client leave, so whatever it holds (the tenant's concurrency
  lease) is released at once, not after `request_timeout_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lockgate.gateway.errors import APIError
from lockgate.gateway.root_path import route_path
from lockgate.gateway.settings import Settings

logger = logging.getLogger(__name__)
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class HeaderLimit(Exception):
    """Raised in a parser callback to stop the parse (uvicorn then answers through
    `send_400_response`, which sends the limit's own answer instead)."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    max_header_bytes = 64 << 10
    max_headers = 100
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_headers = True
        self._header_bytes = 0
        self._num_headers = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        in_headers = self._in_headers
        super().data_received(data)
        if in_headers and self._in_headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._refuse(431, f"The request's headers exceed {self.max_header_bytes} bytes.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = self._num_headers = 0
        if self._deadline is None:
            self._arm()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.max_headers:
            self._refusal = (431, f"The request has more than {self.max_headers} headers.")
            raise HeaderLimit(self._refusal[1])
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            super().send_400_response(msg)
        else:
            self._refuse(*self._refusal)

    # -- helpers ---------------------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self._in_headers and not self.transport.is_closing():
            self._refuse(408, f"The request's headers did not arrive within {self.header_timeout_s} s.")

    def _refuse(self, status: int, message: str) -> None:
        """An OpenAI-shaped error, then the connection closed."""
        logger.info("refused a connection from %s: %s", self.client, message)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": "request_header_fields_too_large" if status == 431
                                     else "request_timeout"}}).encode()
        head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" \
               b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body))
        self._disarm()
        self.transport.write(head + body)
        self.transport.close()


def limited_http(settings: Settings) -> type[LimitedHttpToolsProtocol]:
    """The protocol class with `settings`' limits."""
    return type("LockgateHttp", (LimitedHttpToolsProtocol,), {
        "max_header_bytes": settings.max_header_bytes, "max_headers": settings.max_headers,
        "header_timeout_s": settings.header_timeout_s})


# -- the body ---------------------------------------------------------------------------------------
async def refuse_too_large(receive: Receive, send: Send, limit: int, linger_s: float) -> None:
    """413 at once and whole (its length given), then the rest of the upload read and
    dropped for up to `linger_s` before the connection is closed: closing under a client
    still sending would reset the connection, and the client would never read the 413."""
    body = APIError(413, f"The request body exceeds {limit} bytes.", code="request_too_large").response().body
    await send({"type": "http.response.start", "status": 413, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": True})
    with anyio.move_on_after(linger_s):
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                break
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class BodyLimits:
    """ASGI middleware: a body's size (for one without Content-Length) and its read deadline,
    enforced in the `receive` the app reads it through (see the module's docstring)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, max_upload_bytes: int,
                 upload_paths: frozenset[str], timeout_s: float, min_bytes_per_s: int,
                 linger_s: float = 5.0) -> None:
        self.app = app
        self.max_body, self.max_upload, self.upload_paths = max_body_bytes, max_upload_bytes, upload_paths
        self.timeout_s, self.min_rate, self.linger_s = timeout_s, min_bytes_per_s, linger_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_upload if route_path(scope) in self.upload_paths else self.max_body
        body = _Body(self, receive, send, limit)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if body.answered is None:
                raise
            # the app failed on the client's leaving, which is what this answer made it see
            logger.debug("after a %d, %s %s ended with", body.answered, scope.get("method"),
                         scope.get("path"), exc_info=True)


class _Body:
    """One request's body as the app reads it; `answered`: the status this layer sent (the
    app's own sends are dropped from then on, and its reads see the client gone)."""

    def __init__(self, limits: BodyLimits, receive: Receive, send: Send, limit: int) -> None:
        self.limits, self._receive, self._send, self.limit = limits, receive, send, limit
        self.size = 0
        self.first_read: float | None = None
        self.complete = False
        self.started = False          # a response has begun (the app's or this layer's)
        self.answered: int | None = None

    async def send(self, message: Message) -> None:
        if self.answered is not None:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def receive(self) -> Message:
        if self.answered is not None:
            return {"type": "http.disconnect"}
        if self.complete:                 # past the body: waiting for a disconnect, unbounded
            return await self._receive()
        now = time.monotonic()
        if self.first_read is None:
            self.first_read = now
        lim = self.limits
        left = self.first_read + lim.timeout_s + (self.size / lim.min_rate if lim.min_rate else 0) - now
        message: Message | None = None
        with anyio.move_on_after(max(left, 0.0)):
            message = await self._receive()
        if message is None:
            return await self._late()
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limit:
                return await self._too_large()
            self.complete = not message.get("more_body", False)
        return message

    async def _late(self) -> Message:
        waited = time.monotonic() - (self.first_read or 0.0)
        logger.info("a request body was not read in time: %d bytes in %.1f s", self.size, waited)
        if not self.started:
            body = APIError(408, f"The request body did not arrive in time ({self.size} bytes in "
                                 f"{waited:.0f} s); send it faster, or in smaller requests.",
                            code="request_timeout").response().body
            await self._send({"type": "http.response.start", "status": 408, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]})
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
        self.answered = 408
        return {"type": "http.disconnect"}

    async def _too_large(self) -> Message:
        if not self.started:
            await refuse_too_large(self._receive, self._send, self.limit, self.limits.linger_s)
        self.answered = 413
        return {"type": "http.disconnect"}
