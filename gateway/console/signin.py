"""Signing in to the console: an admin (or viewer) key exchanged for a server-side session
(tenancy/console_sessions.py) whose token the browser keeps in an HttpOnly, SameSite=Strict
cookie (Secure over https) scoped to the console's path; signing out. Sign-ins are limited per
client address on this replica and audited, refused ones too; the key is never written."""

from __future__ import annotations

import hmac
import secrets
import time
from collections import deque

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from lockgate.gateway.caller import admin_role
from lockgate.gateway.console.web import (
    COOKIE,
    SIGNIN_COOKIE,
    ConsoleRoute,
    client_of,
    console_path,
    csrf_of,
    current_user,
    form_of,
    render,
    signed_in,
    url_for,
)
from lockgate.gateway.errors import APIError
from lockgate.gateway.state import app_state
from lockgate.tenancy import console_sessions
from lockgate.tenancy.errors import AuthError

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)
WINDOW_S = 60.0
MAX_CLIENTS = 10_000      # addresses remembered; past it the oldest are forgotten


class SignInLimit:
    """At most `per_minute` sign-in attempts per client address in any 60 s, in this process."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self.seen: dict[str, deque[float]] = {}

    def admit(self, client: str, now: float | None = None) -> float:
        """0 when the attempt may go on (and is counted); else the seconds until one may."""
        now = time.monotonic() if now is None else now
        times = self.seen.pop(client, None) or deque()
        while times and times[0] <= now - WINDOW_S:
            times.popleft()
        self.seen[client] = times          # most recently seen last
        if len(times) >= self.per_minute:
            return times[0] + WINDOW_S - now
        times.append(now)
        while len(self.seen) > MAX_CLIENTS:
            del self.seen[next(iter(self.seen))]
        return 0.0


def _limit(request: Request) -> SignInLimit:
    app = request.app
    limit = getattr(app.state, "console_sign_in_limit", None)
    if limit is None:
        limit = app.state.console_sign_in_limit = SignInLimit(app_state(request).settings.console_sign_ins_per_minute)
    return limit


def _safe_back(request: Request, back: str | None) -> str:
    """Where to go once signed in: a console page of this app, else the overview."""
    root = console_path(request)
    if back and (back == root or back.startswith(root + "/")) and "//" not in back and "\\" not in back:
        return back
    return url_for(request, "console_overview")


def sign_in_form(request: Request, *, status: int = 200, back: str | None = None,
                 message: str | None = None) -> Response:
    """The form, its CSRF token tied to a random secret in a cookie of its own."""
    secret = request.cookies.get(SIGNIN_COOKIE) or secrets.token_urlsafe(24)
    response = render(request, "signin.html", None, status=status, csrf=csrf_of(secret),
                      back=_safe_back(request, back), message=message)
    response.set_cookie(SIGNIN_COOKIE, secret, max_age=3600, path=console_path(request), httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
    return response


@router.get("/console/sign-in", name="console_sign_in")
async def sign_in_page(request: Request) -> Response:
    if await current_user(request) is not None:
        return RedirectResponse(url_for(request, "console_overview"), status_code=303)
    return sign_in_form(request, back=request.query_params.get("next"))


async def _refuse(request: Request, reason: str, status: int, message: str, key_id: str | None = None) -> Response:
    async with app_state(request).sessions() as session:
        console_sessions.refused_sign_in(session, reason=reason, client=client_of(request), key_id=key_id)
        await session.commit()
    return sign_in_form(request, status=status, message=message)


@router.post("/console/sign-in", name="console_sign_in_post")
async def sign_in(request: Request) -> Response:
    wait = _limit(request).admit(client_of(request))
    if wait > 0:
        raise APIError(429, f"Too many sign-in attempts from this address; try again in {int(wait) + 1} s.",
                       headers={"Retry-After": str(int(wait) + 1)})
    form = {k: v for k, v in (await request.form()).items() if isinstance(v, str)}
    secret = request.cookies.get(SIGNIN_COOKIE, "")
    if not secret or not hmac.compare_digest(form.get("csrf", ""), csrf_of(secret)):
        raise APIError(403, "The sign-in form's CSRF token is missing or wrong; reload the page.", code="csrf")
    state = app_state(request)
    try:
        p = await state.auth.authenticate(form.get("key", "").strip())
    except AuthError as exc:
        return await _refuse(request, exc.reason or "invalid", 401, "That key is not a valid admin key.")
    if admin_role(p) is None:
        return await _refuse(request, "not_an_admin_key", 403,
                             "That is a tenant's key; the console takes admin and viewer keys only.", p.key_id)
    async with state.sessions() as session:
        token = await console_sessions.open_session(session, key_id=p.key_id, client=client_of(request),
                                                    ttl_s=state.settings.console_session_ttl_s)
    response = RedirectResponse(_safe_back(request, form.get("back")), status_code=303)
    response.set_cookie(COOKIE, token, max_age=int(state.settings.console_session_ttl_s), path=console_path(request),
                        httponly=True, samesite="strict", secure=request.url.scheme == "https")
    response.delete_cookie(SIGNIN_COOKIE, path=console_path(request))
    return response


@router.post("/console/sign-out", name="console_sign_out")
async def sign_out(request: Request) -> Response:
    user = await signed_in(request)
    await form_of(request, user, "overview", "view")
    async with app_state(request).sessions() as session:
        await console_sessions.close_session(session, user.token, key_id=user.key_id)
    response = RedirectResponse(url_for(request, "console_sign_in"), status_code=303)
    response.delete_cookie(COOKIE, path=console_path(request), httponly=True, samesite="strict")
    return response
