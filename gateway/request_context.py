"""`RequestContext`, the gateway's ASGI middleware (plain ASGI: streaming responses pass
straight through)."""

from __future__ import annotations

import re
import secrets

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockgate.gateway.errors import APIError

_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


class RequestContext:
    """Gives every response an `x-request-id` (the client's own when it sent a sane one) and
    refuses bodies over `max_body_bytes` with 413 before any route reads them (on the
    `Content-Length` alone when there is one). Uploads to `/v1/files` have their own limit,
    `max_upload_bytes` (a file and its multipart framing)."""

    UPLOAD_PATHS = frozenset({"/v1/files"})

    def __init__(self, app: ASGIApp, max_body_bytes: int, linger_s: float = 5.0,
                 max_upload_bytes: int | None = None) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.max_upload = max_upload_bytes or max_body_bytes
        self.linger_s = linger_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not _REQUEST_ID.match(rid):
            rid = "req_" + secrets.token_hex(12)
        scope.setdefault("state", {})["request_id"] = rid
        rid_header = (b"x-request-id", rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        length = headers.get(b"content-length")
        limit = self.max_upload if scope.get("path") in self.UPLOAD_PATHS else self.max_body
        too_big = False
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                too_big = True
        body_chunks: list[bytes] | None = None
        if not too_big and scope["method"] in ("POST", "PUT", "PATCH") and length is None:
            # chunked upload: read it here, within the limit, then replay it
            body_chunks, size = [], 0
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                chunk = msg.get("body", b"")
                size += len(chunk)
                if size > limit:
                    too_big = True
                    break
                body_chunks.append(chunk)
                if not msg.get("more_body"):
                    break
        if too_big:
            await self.refuse_too_large(receive, send_with_id, limit)
            return
        if body_chunks is not None:
            body = b"".join(body_chunks)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send_with_id)
            return
        await self.app(scope, receive, send_with_id)


    async def refuse_too_large(self, receive: Receive, send: Send, limit: int) -> None:
        """413 at once and whole (its length given), then the rest of the upload read and
        dropped for up to `linger_s` before the connection is closed: closing under a client
        still sending would reset the connection, and the client would never read the 413."""
        body = APIError(413, f"The request body exceeds {limit} bytes.",
                        code="request_too_large").response().body
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        with anyio.move_on_after(self.linger_s):
            while True:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body"):
                    break
        await send({"type": "http.response.body", "body": b"", "more_body": False})


# -- start-up ----------------------------------------------------------------------------------------
