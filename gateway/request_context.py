"""`RequestContext`, the gateway's ASGI middleware (plain ASGI: streaming responses pass
straight through)."""

from __future__ import annotations

import re
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockgate.gateway.http_limits import refuse_too_large
from lockgate.gateway.root_path import route_path

_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,128}$")


class RequestContext:
    """Gives every response an `x-request-id` (the client's own when it sent a sane one) and
    refuses bodies declared (`Content-Length`) over `max_body_bytes` with 413 before any route
    reads them; a body without one is counted as it is read (gateway/http_limits.py's
    `BodyLimits`), never buffered here. Uploads to `/v1/files` have their own limit,
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
        limit = self.max_upload if route_path(scope) in self.UPLOAD_PATHS else self.max_body
        too_big = False
        if length is not None:
            try:
                too_big = int(length) > limit
            except ValueError:
                too_big = True
        if too_big:
            await self.refuse_too_large(receive, send_with_id, limit)
            return
        await self.app(scope, receive, send_with_id)

    async def refuse_too_large(self, receive: Receive, send: Send, limit: int) -> None:
        await refuse_too_large(receive, send, limit, self.linger_s)
