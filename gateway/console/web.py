"""What every console page shares: the templates (autoescaped), root-relative URLs under the
app's root path, the signed-in user (a session cookie -> its admin key, read afresh on every
request), the CSRF token tied to the session, the one authorization check (`caller.may`
through `actions.allowed`), errors as HTML pages, and the security headers of every answer
under /console."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape
from pydantic import ValidationError
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockgate.gateway.caller import admin_role
from lockgate.gateway.console.actions import ACTION_BY_NAME, allowed
from lockgate.gateway.errors import APIError, is_database_down
from lockgate.gateway.root_path import route_path
from lockgate.gateway.state import app_state
from lockgate.tenancy import auth, console_sessions
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import AuthError, Conflict, Invalid, NotFound

HERE = Path(__file__).resolve().parent
COOKIE = "lockgate_console"
SIGNIN_COOKIE = "lockgate_console_signin"      # the sign-in form's CSRF secret, before any session
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; base-uri 'none'; frame-ancestors 'none'")
HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
           (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY"),
           (b"cache-control", b"no-store")]

templates = Jinja2Templates(env=Environment(loader=FileSystemLoader(HERE / "templates"),
                                            autoescape=select_autoescape(default=True, default_for_string=True)))
templates.env.filters["datetime"] = lambda ts: datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S")


def url_for(request: Request, name: str, **params: Any) -> str:
    """A root-relative URL of the route `name`, under the app's root path (`--root-path`)."""
    return request.scope.get("root_path", "") + str(request.app.url_path_for(name, **params))


def console_path(request: Request) -> str:
    """The path every console cookie is scoped to."""
    return request.scope.get("root_path", "") + "/console"


def csrf_of(secret: str) -> str:
    """The CSRF token of a session (or of a sign-in form's secret): tied to it, never stored."""
    return hmac.new(secret.encode(), b"lockgate-console-csrf", hashlib.sha256).hexdigest()


def client_of(request: Request) -> str:
    return request.client.host if request.client else "unknown"


@dataclass(frozen=True)
class ConsoleUser:
    principal: Principal
    role: str            # "admin" or "viewer" (caller.ADMIN_ROLES)
    token: str

    @property
    def key_id(self) -> str:
        return self.principal.key_id

    @property
    def csrf(self) -> str:
        return csrf_of(self.token)

    def may(self, page: str, action: str) -> bool:
        return allowed(self.role, page, action)


async def current_user(request: Request) -> ConsoleUser | None:
    """The session's user, or None: no cookie, an unknown or expired session, or a key that
    can no longer be used (revoked, expired, no admin role)."""
    token = request.cookies.get(COOKIE)
    if not token:
        return None
    async with app_state(request).sessions() as session:
        key_id = await console_sessions.session_key_id(session, token)
        if key_id is None:
            return None
        try:
            p = await auth.principal_of_key(session, key_id)
        except AuthError:
            return None
    role = admin_role(p)
    return ConsoleUser(p, role, token) if role is not None else None


async def signed_in(request: Request) -> ConsoleUser:
    """The user, or 401 (the sign-in form, in `ConsoleRoute`)."""
    user = await current_user(request)
    if user is None:
        raise APIError(401, "Sign in with an admin key.", code="console_sign_in")
    return user


def authorize(user: ConsoleUser, page: str, action: str) -> None:
    """403 unless the user's role may do `action` on `page`: the rule the /admin/v1 route the
    action stands for applies (`actions.ACTIONS`)."""
    if not user.may(page, action):
        a = ACTION_BY_NAME[(page, action)]
        raise APIError(403, f"A {user.role} key may not do this ({a.method} {a.api} is refused to it).",
                       code="read_only_key")


async def form_of(request: Request, user: ConsoleUser, page: str, action: str) -> dict[str, str]:
    """A POSTed form of a signed-in user, its CSRF token checked (403 without it), the
    action authorized; its fields as strings."""
    form = await request.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    if not hmac.compare_digest(fields.get("csrf", ""), user.csrf):
        raise APIError(403, "The form's CSRF token is missing or wrong; reload the page and try again.",
                       code="csrf")
    authorize(user, page, action)
    return fields


def render(request: Request, name: str, user: ConsoleUser | None, *, status: int = 200,
           **context: Any) -> Response:
    return templates.TemplateResponse(
        request, name, {"user": user, "url": lambda n, **p: url_for(request, n, **p), **context},
        status_code=status)


def _error_status(exc: Exception) -> tuple[int, str] | None:
    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, NotFound):
        return 404, str(exc)
    if isinstance(exc, Conflict):
        return 409, str(exc)
    if isinstance(exc, Invalid):
        return 400, str(exc)
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "form"
        return 400, f"{field}: {first['msg']}"
    if is_database_down(exc):
        return 503, "The database is unavailable; try again shortly."
    return None


class ConsoleRoute(APIRoute):
    """A console page: a refusal renders as an HTML page with its status (401: the sign-in
    form, which brings the user back here)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def page(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:
                found = _error_status(exc)
                if found is None:
                    raise
                status, message = found
                if status == 401:
                    from lockgate.gateway.console.signin import sign_in_form

                    return sign_in_form(request, status=401, back=request.url.path)
                user = await current_user(request) if status != 503 else None
                return render(request, "error.html", user, status=status, status_code=status, message=message)

        return page


class SecurityHeaders:
    """Every answer under /console (pages, fragments, static files, errors) sends the CSP
    (no framing, scripts of our own only) and its siblings."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _under_console(scope):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {n for n, _ in HEADERS}
                message["headers"] = [*(h for h in message.get("headers", []) if h[0] not in names), *HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def _under_console(scope: Scope) -> bool:
    path = route_path(scope)
    return path == "/console" or path.startswith("/console/")
