"""The console's tenants and keys: a page of tenants (search by name, keyset pages), one
tenant (plan, quotas, keys; edit its quota, soft-delete it, give it a key), the admin and
viewer keys; a new key's secret shown once, on the answer to the form that made it. Every
change is the `admin_service` call the /admin/v1 route makes, after the same authorization."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from lockgate.gateway import admin_service as service
from lockgate.gateway.console.web import ConsoleRoute, ConsoleUser, authorize, form_of, render, signed_in, url_for
from lockgate.gateway.errors import APIError
from lockgate.gateway.schemas import AdminKeyCreate, KeyCreate, QuotaBody, TenantCreate
from lockgate.gateway.state import app_state
from lockgate.tenancy import api_keys, tenants
from lockgate.tenancy.quota import QUOTA_FIELDS, quota_of

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)
PAGE = 25


def _redirect(request: Request, name: str, **params: str) -> Response:
    return RedirectResponse(url_for(request, name, **params), status_code=303)


@router.get("/console/tenants", name="console_tenants")
async def tenants_page(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "tenants", "view")
    q = request.query_params
    name, after = (q.get("q") or "").strip() or None, q.get("after") or None
    if name is not None and len(name) > 64:
        raise APIError(400, "q: at most 64 characters", param="q")
    async with app_state(request).sessions() as session:
        rows, has_more = await service.tenant_page(session, limit=PAGE, after=after, name=name)
    return render(request, "tenants.html", user, tenants=rows, has_more=has_more, q=name or "",
                  next_after=rows[-1].id if rows and has_more else None)


@router.post("/console/tenants", name="console_tenant_create")
async def tenant_create(request: Request) -> Response:
    user = await signed_in(request)
    form = await form_of(request, user, "tenants", "create")
    body = TenantCreate.model_validate({"name": form.get("name", "").strip(), "weight": form.get("weight") or 1.0})
    state = app_state(request)
    async with state.sessions() as session:
        t = await service.create_tenant(state, session, body, actor=user.key_id)
    return _redirect(request, "console_tenant", tenant_id=t.id)


async def _tenant_page(request: Request, user: ConsoleUser, tenant_id: str, *, status: int = 200,
                       created: tuple[object, str] | None = None) -> Response:
    async with app_state(request).sessions() as session:
        t = await tenants.get_tenant(session, tenant_id)
        keys = await api_keys.list_keys(session, tenant_id)
    return render(request, "tenant.html", user, status=status, tenant=t, quota=quota_of(t).to_dict(),
                  keys=keys, created=created)


@router.get("/console/tenants/{tenant_id}", name="console_tenant")
async def tenant_page(request: Request, tenant_id: str) -> Response:
    user = await signed_in(request)
    authorize(user, "tenant", "view")
    return await _tenant_page(request, user, tenant_id)


def _quota_body(form: dict[str, str]) -> QuotaBody:
    """Blank is unlimited; anything else must be a whole number (400 naming the field)."""
    values: dict[str, int | None] = {}
    for name in QUOTA_FIELDS:
        raw = form.get(name, "").strip().replace("_", "")
        if raw and not raw.isdigit():
            raise APIError(400, f"{name}: a whole number of at least 0, or blank for no limit", param=name)
        values[name] = int(raw) if raw else None
    return QuotaBody(**values)


@router.post("/console/tenants/{tenant_id}/quota", name="console_tenant_quota")
async def tenant_quota(request: Request, tenant_id: str) -> Response:
    user = await signed_in(request)
    form = await form_of(request, user, "tenant", "edit_quota")
    state = app_state(request)
    async with state.sessions() as session:
        await service.set_quota(state, session, tenant_id, _quota_body(form), actor=user.key_id)
    return _redirect(request, "console_tenant", tenant_id=tenant_id)


@router.post("/console/tenants/{tenant_id}/delete", name="console_tenant_delete")
async def tenant_delete(request: Request, tenant_id: str) -> Response:
    user = await signed_in(request)
    await form_of(request, user, "tenant", "delete")
    state = app_state(request)
    async with state.sessions() as session:
        await service.delete_tenant(state, session, tenant_id, actor=user.key_id)
    return _redirect(request, "console_tenants")


@router.post("/console/tenants/{tenant_id}/keys", name="console_tenant_key_create")
async def tenant_key_create(request: Request, tenant_id: str) -> Response:
    """The key's secret is in this answer only: the page a later GET renders has none."""
    user = await signed_in(request)
    form = await form_of(request, user, "tenant", "create_key")
    state = app_state(request)
    async with state.sessions() as session:
        k, plaintext = await service.create_tenant_key(state, session, tenant_id,
                                                       KeyCreate.model_validate({"name": form.get("name", "").strip()}),
                                                       actor=user.key_id)
    return await _tenant_page(request, user, tenant_id, status=201, created=(k, plaintext))


async def _keys_page(request: Request, user: ConsoleUser, *, status: int = 200,
                     created: tuple[object, str] | None = None) -> Response:
    async with app_state(request).sessions() as session:
        keys = await api_keys.list_keys(session, None)
    return render(request, "keys.html", user, status=status, keys=keys, created=created)


@router.get("/console/keys", name="console_keys")
async def keys_page(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "keys", "view")
    return await _keys_page(request, user)


@router.post("/console/keys", name="console_key_create")
async def key_create(request: Request) -> Response:
    user = await signed_in(request)
    form = await form_of(request, user, "keys", "create")
    role = form.get("role") or "admin"
    if role not in ("admin", "viewer"):
        raise APIError(400, "role: admin or viewer", param="role")
    body = AdminKeyCreate.model_validate({"name": form.get("name", "").strip(), "scopes": [role]})
    state = app_state(request)
    async with state.sessions() as session:
        created = await service.create_admin_key(state, session, body, actor=user.key_id)
    return await _keys_page(request, user, status=201, created=created)


@router.post("/console/keys/{key_id}/revoke", name="console_key_revoke")
async def key_revoke(request: Request, key_id: str) -> Response:
    user = await signed_in(request)
    await form_of(request, user, "keys", "revoke")
    state = app_state(request)
    async with state.sessions() as session:
        k = await api_keys.get_key(session, key_id)
        await service.revoke_key(state, session, key_id, actor=user.key_id)
    if k.tenant_id is not None:
        return _redirect(request, "console_tenant", tenant_id=k.tenant_id)
    return _redirect(request, "console_keys")
