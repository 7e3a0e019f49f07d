"""Who is calling: the bearer key -> a `Principal` (401 without a valid one), and the two
roles a route may require, tenant and admin (403 for the other). `gateway.deps` wraps them
as route parameters."""

from __future__ import annotations

from fastapi import Request

from lockgate.gateway.errors import APIError
from lockgate.gateway.state import app_state
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import AuthError

__all__ = ["admin_principal", "bearer", "principal", "tenant_principal"]

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


async def admin_principal(request: Request) -> Principal:
    """An admin key (no tenant, scope `admin`): every /admin route."""
    p = await principal(request)
    if p.tenant_id is not None or not p.is_admin:
        raise APIError(403, "This route needs an admin API key.", code="admin_only")
    return p
