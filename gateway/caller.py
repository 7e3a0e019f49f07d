"""Who is calling: the bearer key -> a `Principal` (401 without a valid one), and the roles a
route may require: tenant, or one of the admin side's (403 for the others). `gateway.deps`
wraps them as route parameters.

The admin side's rule lives here alone (`may`): an "admin" key may call every admin method, a
"viewer" key only the reading ones (GET, HEAD). The /admin routes (`admin_principal`) and the
console's pages and actions (gateway/console/) both ask it."""

from __future__ import annotations

from fastapi import Request

from lockgate.gateway.errors import APIError
from lockgate.gateway.state import app_state
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import AuthError

__all__ = ["ADMIN_ROLES", "admin_principal", "admin_role", "authorize_admin", "bearer", "may", "principal",
           "tenant_principal"]

ADMIN_ROLES = ("admin", "viewer")
READ_METHODS = frozenset({"GET", "HEAD"})

_AUTH_MESSAGES = {
    "missing": "You didn't provide an API key. Send it as 'Authorization: Bearer lg-...'.",
    "invalid": "Incorrect API key provided.",
    "expired": "The API key has expired.",
    "revoked": "The API key has been revoked.",
    "tenant_suspended": "The tenant of this API key is suspended.",
    "tenant_deleted": "The tenant of this API key no longer exists.",
}


def bearer(request: Request) -> str | None:
    """The presented key: the bearer token, else `x-api-key`; "" for an unusable
    Authorization header, None when there is none."""
    header = request.headers.get("authorization")
    if header:
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return ""
    return request.headers.get("x-api-key") or None


async def principal(request: Request) -> Principal:
    """The caller's principal, authenticated once per request (kept in `request.state`)."""
    known: Principal | None = getattr(request.state, "principal", None)
    if known is not None:
        return known
    key = bearer(request)
    if key is None:
        raise APIError(401, _AUTH_MESSAGES["missing"], code="missing_api_key")
    state = app_state(request)
    try:
        p = await state.auth.authenticate(key)
    except AuthError as exc:
        code = "invalid_api_key" if exc.reason in ("invalid", "missing") else exc.reason
        raise APIError(401, _AUTH_MESSAGES.get(exc.reason, "Invalid API key."), code=code) from None
    request.state.principal = p
    return p


async def tenant_principal(request: Request) -> Principal:
    """A tenant's key with the `inference` scope (the /v1 routes)."""
    p = await principal(request)
    if p.tenant_id is None:
        raise APIError(403, "Admin keys belong to no tenant and cannot call tenant routes; "
                       "use a tenant's API key.", code="admin_key_not_allowed")
    if "inference" not in p.scopes:
        raise APIError(403, "This API key lacks the 'inference' scope.", code="insufficient_scope")
    return p


def admin_role(p: Principal) -> str | None:
    """"admin" or "viewer" for a key without a tenant holding that scope; None otherwise."""
    if p.tenant_id is not None:
        return None
    return next((r for r in ADMIN_ROLES if r in p.scopes), None)


def may(role: str | None, method: str) -> bool:
    """Whether an admin-side `role` may make a request of HTTP `method`: the one rule."""
    return role == "admin" or (role == "viewer" and method.upper() in READ_METHODS)


def authorize_admin(p: Principal, method: str) -> str:
    """The caller's admin role if it `may` use `method`; 403 otherwise."""
    role = admin_role(p)
    if role is None:
        raise APIError(403, "This route needs an admin API key.", code="admin_only")
    if not may(role, method):
        raise APIError(403, "This API key is a viewer key: it may read the admin routes (GET) "
                       "and change nothing.", code="read_only_key")
    return role


async def admin_principal(request: Request) -> Principal:
    """An admin key (no tenant, scope `admin`, or `viewer` for GET and HEAD): every /admin route."""
    p = await principal(request)
    authorize_admin(p, request.method)
    return p
