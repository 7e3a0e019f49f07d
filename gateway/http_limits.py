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
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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
