"""`AdminRoute`: every /admin route authenticates its admin key before anything else, and
`admin_router()` makes the routers whose routes are all of that kind."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute

from lockgate.gateway.caller import admin_principal


class AdminRoute(APIRoute):
    """Authenticates before FastAPI reads the body: a caller without an admin key learns
    nothing (not even that a body was malformed) and gets 401/403 first. The principal is
    kept on the request, so a route's `AdminDep` reads it without a second lookup."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def authenticated(request: Request) -> Response:
            await admin_principal(request)
            return await handler(request)

        return authenticated


def admin_router(**kwargs: Any) -> APIRouter:
    """A router whose every route is an `AdminRoute`, so none can be left open."""
    return APIRouter(route_class=AdminRoute, **kwargs)
