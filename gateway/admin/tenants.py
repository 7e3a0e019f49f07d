"""/admin/v1/tenants: create, list, read, change, delete tenants, and set a tenant's quota."""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import Query

from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.deps import AdminDep, SessionDep, StateDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.schemas import (
    DeletedPublic,
    QuotaBody,
    TenantCreate,
    TenantPagePublic,
    TenantPatch,
    TenantPublic,
)
from lockgate.gateway.state import AppState
from lockgate.tenancy import adapters, tenants

logger = logging.getLogger(__name__)
router = admin_router()


def _after_tenant_change(state: AppState, t: Any) -> None:
    """Cached principals of the tenant forgotten; its fairness weight pushed to the engines."""
    state.auth.keys.invalidate_tenant(t.id)
    if t.deleted_at is None:
        state.models.push_weight(t.id, t.weight)


async def check_model_names(state: AppState, session: Any, names: list[str] | None) -> None:
    """A tenant's model list names served models and registered adapters only: an unknown
    name (a typo) would lock the tenant out of every model, so it is a 400 naming it."""
    unknown = [n for n in names or [] if n not in state.models]
    if unknown:
        found = await adapters.adapter_ids_by_name(session, unknown)
        unknown = [n for n in unknown if n not in found]
    if unknown:
        raise APIError(400, f"models: {', '.join(repr(n) for n in unknown)} "
                       f"{'is' if len(unknown) == 1 else 'are'} neither a served model nor an adapter "
                       f"(served: {', '.join(sorted(state.models))})", param="models",
                       code="unknown_model")


def check_alias_targets(state: AppState, aliases: dict[str, str] | None) -> None:
    """A tenant's model aliases name served models only (400 naming the alias otherwise)."""
    for name, target in (aliases or {}).items():
        if target not in state.models:
            raise APIError(400, f"model_aliases.{name}: {target!r} is not a served model "
                           f"(served: {', '.join(sorted(state.models))})", param="model_aliases",
                           code="unknown_model")


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, state: StateDep, session: SessionDep,
                        admin: AdminDep) -> TenantPublic:
    await check_model_names(state, session, body.models)
    check_alias_targets(state, body.model_aliases)
    t = await tenants.create_tenant(
        session, name=body.name, weight=body.weight, service_tiers=body.service_tiers,
        default_tier=body.default_tier, models=body.models, status=body.status,
        quota=body.quota.quota() if body.quota else None, cached_input_price=body.cached_input_price,
        model_aliases=body.model_aliases, actor=admin.key_id)
    _after_tenant_change(state, t)
    return TenantPublic.from_row(t)


@router.get("/tenants")
async def list_tenants(session: SessionDep, limit: Annotated[int, Query(ge=1, le=500)] = 50,
                       after: str | None = None) -> TenantPagePublic:
    rows = await tenants.list_tenants(session, limit=limit + 1, after=after)
    has_more = len(rows) > limit
    rows = rows[:limit]
    return TenantPagePublic(data=[TenantPublic.from_row(t) for t in rows], has_more=has_more,
                            last_id=rows[-1].id if rows else None)


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, session: SessionDep) -> TenantPublic:
    return TenantPublic.from_row(await tenants.get_tenant(session, tenant_id))


@router.patch("/tenants/{tenant_id}")
async def patch_tenant(tenant_id: str, body: TenantPatch, state: StateDep, session: SessionDep,
                       admin: AdminDep) -> TenantPublic:
    changes = body.model_dump(exclude_unset=True)
    if not changes:
        raise APIError(400, "the body changes nothing; give at least one field")
    for name in ("name", "weight", "status", "service_tiers", "default_tier", "cached_input_price"):
        if name in changes and changes[name] is None:
            raise APIError(400, f"{name}: may not be null", param=name)
    await check_model_names(state, session, changes.get("models"))
    check_alias_targets(state, changes.get("model_aliases"))
    t = await tenants.update_tenant(session, tenant_id, actor=admin.key_id, **changes)
    _after_tenant_change(state, t)
    return TenantPublic.from_row(t)


@router.delete("/tenants/{tenant_id}")
async def delete_tenant(tenant_id: str, state: StateDep, session: SessionDep,
                        admin: AdminDep) -> DeletedPublic:
    """Soft delete: keys revoked, private adapters deleted (off this replica's engines now,
    unless a request still uses one: then at the next sweep, as on other replicas)."""
    await tenants.delete_tenant(session, tenant_id, actor=admin.key_id)
    state.auth.keys.invalidate_tenant(tenant_id)
    try:
        await state.models.adapters.sweep()
    except Exception:  # any failure, logged: the periodic sweep tries again; the rows are gone
        logger.warning("adapter sweep after deleting tenant %s failed", tenant_id, exc_info=True)
    return DeletedPublic(id=tenant_id, object="tenant")


@router.put("/tenants/{tenant_id}/quota")
async def put_quota(tenant_id: str, body: QuotaBody, state: StateDep, session: SessionDep,
                    admin: AdminDep) -> TenantPublic:
    t = await tenants.set_quota(session, tenant_id, body.quota(), actor=admin.key_id)
    _after_tenant_change(state, t)
    return TenantPublic.from_row(t)
