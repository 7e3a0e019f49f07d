"""While the server drains (SIGTERM until its admitted requests end), it keeps accepting
connections and answers every new request 503 `server_draining` (with `Retry-After` and
`Connection: close`), so a client or load balancer learns to go elsewhere instead of meeting a
refused connection. `/health`, `/ready` (which says `draining`) and `/metrics` still answer."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from lockgate.gateway.errors import APIError
from lockgate.gateway.root_path import route_path

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


def draining_error() -> APIError:
    return APIError(503, "The server is shutting down; retry on another replica.",
                    code="server_draining", headers={"retry-after": "5"})


class DrainGate:
    """ASGI middleware: the 503 above for new requests once `app.state.lifecycle.draining`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in OPEN_PATHS:
            lifecycle = getattr(scope["app"].state, "lifecycle", None)
            if lifecycle is not None and lifecycle.draining:
                response = draining_error().response()
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
