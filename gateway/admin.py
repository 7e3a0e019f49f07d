"""The admin REST console under /admin/v1: tenants, keys, quotas, adapters, usage, the engine.

Every route depends on `admin_principal` through the router, so a route added here cannot
be left open: no key is 401, a tenant's key is 403.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engine import LoRAError
from gateway.auth import admin_principal, app_state
from gateway.errors import APIError
from gateway.state import AdapterInfo, AppState
from gateway.usage_api import usage_response
from tenancy import service
from tenancy.errors import Conflict, Invalid, NotFound
from tenancy.models import Tenant, new_adapter_id
from tenancy.quota import Quota
from tenancy.service import Principal

logger = logging.getLogger(__name__)


class AdminRoute(APIRoute):
    """Authenticates before FastAPI reads the body: a caller without an admin key learns
    nothing (not even that a body was malformed) and gets 401/403 first."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def authenticated(request: Request):
            await admin_principal(request)
            return await handler(request)

        return authenticated


router = APIRouter(prefix="/admin/v1", dependencies=[Depends(admin_principal)], route_class=AdminRoute)

Tier = Literal["default", "priority", "flex"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QuotaBody(_Strict):
    requests_per_minute: int | None = Field(default=None, ge=0)
    tokens_per_minute: int | None = Field(default=None, ge=0)
    max_concurrent_requests: int | None = Field(default=None, ge=0)
    daily_token_budget: int | None = Field(default=None, ge=0)
    monthly_token_budget: int | None = Field(default=None, ge=0)

    def quota(self) -> Quota:
        return Quota(**self.model_dump())


class TenantCreate(_Strict):
    name: str = Field(min_length=1, max_length=64)
    weight: float = Field(default=1.0, gt=0, le=1000)
    service_tiers: list[Tier] | None = None
    default_tier: Tier | None = None
    models: list[str] | None = None
    status: Literal["active", "suspended"] = "active"
    quota: QuotaBody | None = None


class TenantPatch(_Strict):
    name: str | None = Field(default=None, min_length=1, max_length=64)
    weight: float | None = Field(default=None, gt=0, le=1000)
    service_tiers: list[Tier] | None = None
    default_tier: Tier | None = None
    models: list[str] | None = None
    status: Literal["active", "suspended"] | None = None


class KeyCreate(_Strict):
    name: str = Field(min_length=1, max_length=128)
    expires_at: datetime | None = None
    scopes: list[Literal["inference", "admin"]] | None = None
    quota: QuotaBody | None = None


class AdminKeyCreate(_Strict):
    name: str = Field(min_length=1, max_length=128)
    expires_at: datetime | None = None


class AdapterCreate(_Strict):
    name: str = Field(min_length=1, max_length=64)
    base_model: str = Field(min_length=1, max_length=128)
    owner_tenant_id: str | None          # required; null: every tenant may use it
    path: str = Field(min_length=1, max_length=1024)    # a directory under the adapter root


@asynccontextmanager
async def _session(request: Request) -> AsyncIterator[Any]:
    state = app_state(request)
    assert state.sessions is not None
    try:
        async with state.sessions() as session:
            yield session
    except NotFound as exc:
        raise APIError(404, str(exc), code="not_found") from None
    except Conflict as exc:
        raise APIError(409, str(exc), param=getattr(exc, "field", None), code="conflict") from None
    except Invalid as exc:
        raise APIError(400, str(exc), param=getattr(exc, "field", None)) from None


def _iso(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).isoformat()


def tenant_json(t: Any) -> dict:
    return {
        "id": t.id, "object": "tenant", "name": t.name, "status": t.status, "weight": t.weight,
        "service_tiers": list(t.service_tiers), "default_tier": t.default_tier,
        "models": list(t.models) if t.models is not None else None,
        "quota": service.tenant_quota(t).to_dict(),
        "created_at": _iso(t.created_at), "updated_at": _iso(t.updated_at),
    }


def key_json(k: Any) -> dict:
    return {
        "id": k.id, "object": "api_key", "name": k.name, "prefix": k.prefix,
        "tenant_id": k.tenant_id, "scopes": list(k.scopes),
        "created_at": _iso(k.created_at), "expires_at": _iso(k.expires_at),
        "revoked_at": _iso(k.revoked_at), "last_used_at": _iso(k.last_used_at),
        "quota": service.key_quota(k).to_dict(),
    }


def _actor(request: Request) -> str:
    p: Principal = request.state.principal
    return p.key_id


def _after_tenant_change(request: Request, t: Any) -> None:
    state = app_state(request)
    state.keys.invalidate_tenant(t.id)
    if t.deleted_at is None:
        state.push_weight(t.id, t.weight)


# -- tenants --------------------------------------------------------------------------------------
@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, request: Request) -> dict:
    async with _session(request) as s:
        t = await service.create_tenant(
            s, name=body.name, weight=body.weight, service_tiers=body.service_tiers,
            default_tier=body.default_tier, models=body.models, status=body.status,
            quota=body.quota.quota() if body.quota else None, actor=_actor(request))
    _after_tenant_change(request, t)
    return tenant_json(t)


@router.get("/tenants")
async def list_tenants(request: Request, limit: int = Query(50, ge=1, le=500),
                       after: str | None = None) -> dict:
    async with _session(request) as s:
        rows = await service.list_tenants(s, limit=limit + 1, after=after)
    has_more = len(rows) > limit
    rows = rows[:limit]
    return {"object": "list", "data": [tenant_json(t) for t in rows], "has_more": has_more,
            "last_id": rows[-1].id if rows else None}


@router.get("/tenants/{tenant_id}")
async def get_tenant(tenant_id: str, request: Request) -> dict:
    async with _session(request) as s:
        return tenant_json(await service.get_tenant(s, tenant_id))


@router.patch("/tenants/{tenant_id}")
async def patch_tenant(tenant_id: str, body: TenantPatch, request: Request) -> dict:
    changes = body.model_dump(exclude_unset=True)
    if not changes:
        raise APIError(400, "the body changes nothing; give at least one field")
    for name in ("name", "weight", "status", "service_tiers", "default_tier"):
        if name in changes and changes[name] is None:
            raise APIError(400, f"{name}: may not be null", param=name)
    async with _session(request) as s:
        t = await service.update_tenant(s, tenant_id, actor=_actor(request), **changes)
    _after_tenant_change(request, t)
    return tenant_json(t)


@router.delete("/tenants/{tenant_id}")
async def delete_tenant(tenant_id: str, request: Request) -> dict:
    """Soft delete: keys revoked, private adapters deleted (off this replica's engines now,
    unless a request still uses one: then at the next sweep, as on other replicas)."""
    state = app_state(request)
    async with _session(request) as s:
        await service.delete_tenant(s, tenant_id, actor=_actor(request))
    state.keys.invalidate_tenant(tenant_id)
    try:
        await state.adapters.sweep()
    except Exception:  # noqa: BLE001 - the periodic sweep tries again; the rows are gone
        logger.warning("adapter sweep after deleting tenant %s failed", tenant_id, exc_info=True)
    return {"id": tenant_id, "object": "tenant", "deleted": True}


@router.put("/tenants/{tenant_id}/quota")
async def put_quota(tenant_id: str, body: QuotaBody, request: Request) -> dict:
    async with _session(request) as s:
        t = await service.set_quota(s, tenant_id, body.quota(), actor=_actor(request))
    _after_tenant_change(request, t)
    return tenant_json(t)


# -- keys ---------------------------------------------------------------------------------------------
@router.post("/tenants/{tenant_id}/keys", status_code=201)
async def create_key(tenant_id: str, body: KeyCreate, request: Request) -> dict:
    state = app_state(request)
    async with _session(request) as s:
        await service.get_tenant(s, tenant_id)
        k, plaintext = await service.create_key(
            s, tenant_id=tenant_id, name=body.name, scopes=tuple(body.scopes or ("inference",)),
            expires_at=body.expires_at, quota=body.quota.quota() if body.quota else None,
            pepper=state.pepper, actor=_actor(request))
    return {**key_json(k), "key": plaintext}


@router.get("/tenants/{tenant_id}/keys")
async def list_keys(tenant_id: str, request: Request) -> dict:
    async with _session(request) as s:
        await service.get_tenant(s, tenant_id)
        keys = await service.list_keys(s, tenant_id)
    return {"object": "list", "data": [key_json(k) for k in keys]}


@router.post("/keys", status_code=201)
async def create_admin_key(body: AdminKeyCreate, request: Request) -> dict:
    state = app_state(request)
    async with _session(request) as s:
        k, plaintext = await service.create_key(
            s, tenant_id=None, name=body.name, scopes=("admin",), expires_at=body.expires_at,
            pepper=state.pepper, actor=_actor(request))
    return {**key_json(k), "key": plaintext}


@router.get("/keys/{key_id}")
async def get_key(key_id: str, request: Request) -> dict:
    async with _session(request) as s:
        return key_json(await service.get_key(s, key_id))


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: str, request: Request) -> dict:
    async with _session(request) as s:
        await service.revoke_key(s, key_id, actor=_actor(request))
    app_state(request).keys.invalidate_key_id(key_id)
    return {"id": key_id, "object": "api_key", "revoked": True}


# -- adapters -------------------------------------------------------------------------------------
def adapter_json(a: Any, state: AppState) -> dict:
    entry = state.models.get(a.base_model)
    return {
        "id": a.id, "object": "adapter", "name": a.name, "base_model": a.base_model,
        "owner_tenant_id": a.owner_tenant_id, "public": a.owner_tenant_id is None,
        "path": a.path, "rank": a.rank, "targets": list(a.targets),
        "created_at": _iso(a.created_at),
        # served by this replica's engine now (others read it on first use)
        "registered": entry is not None and state.adapters.is_current(entry.engine, a.name, a.id),
    }


def _lora_error(exc: LoRAError, body: AdapterCreate) -> APIError:
    """The engine's refusal as a 400 naming the request's field it is about."""
    msg = str(exc)
    if msg.startswith("lora_name"):
        return APIError(400, f"name: {msg}", param="name")
    if "another base model" in msg:
        return APIError(400, f"base_model: the adapter in {body.path!r} does not fit "
                        f"{body.base_model!r}: {msg}", param="base_model")
    return APIError(400, f"path: the adapter in {body.path!r} cannot be served: {msg}", param="path")


def _in_use(name: str, exc: LoRAError) -> APIError:
    return APIError(409, f"adapter {name!r} is in use by requests on this replica; retry when "
                    f"they have finished ({exc})", code="adapter_in_use")


@router.post("/adapters", status_code=201)
async def create_adapter(body: AdapterCreate, request: Request) -> dict:
    """Check everything, then have the engine read the adapter, then insert the row; if
    the insert fails the engine forgets the adapter again (nothing half-registered)."""
    state = app_state(request)
    if body.name in state.models:
        raise APIError(400, f"name: {body.name!r} is a served model's name", param="name")
    base = state.models.get(body.base_model)
    if base is None:
        raise APIError(400, f"base_model: {body.base_model!r} is not served here (served: "
                       f"{', '.join(sorted(state.models))})", param="base_model")
    assert state.settings.adapter_root is not None
    adapter_id = new_adapter_id()
    catalog = state.adapters
    async with _session(request) as s:
        rel, _ = service.adapter_path(state.settings.adapter_root, body.path)
        await service.check_new_adapter(s, name=body.name, owner_tenant_id=body.owner_tenant_id)
        try:
            catalog.remove_stale(base.engine, body.name, None)   # a deleted namesake, still served
        except LoRAError as exc:
            raise _in_use(body.name, exc) from None
        try:
            adapter = await base.engine.add_lora(catalog.lora_request(adapter_id, body.name, rel))
        except LoRAError as exc:
            catalog.forget_int_id(adapter_id)
            raise _lora_error(exc, body) from None
        try:
            row = await service.create_adapter(
                s, adapter_id=adapter_id, name=body.name, base_model=body.base_model,
                owner_tenant_id=body.owner_tenant_id, path=rel, rank=adapter.rank,
                targets=list(adapter.targets),
                actor=_actor(request))
        except BaseException:
            base.engine.remove_lora(body.name)
            catalog.forget_int_id(adapter_id)
            raise
    catalog.put(AdapterInfo.from_row(row))
    return adapter_json(row, state)


@router.get("/adapters")
async def list_adapters(request: Request) -> dict:
    state = app_state(request)
    async with _session(request) as s:
        rows = await service.list_adapters(s)
    return {"object": "list", "data": [adapter_json(a, state) for a in rows]}


@router.get("/adapters/{adapter_id}")
async def get_adapter(adapter_id: str, request: Request) -> dict:
    async with _session(request) as s:
        return adapter_json(await service.get_adapter(s, adapter_id), app_state(request))


@router.post("/adapters/{adapter_id}/unload")
async def unload_adapter(adapter_id: str, request: Request) -> dict:
    """Drop the adapter's weights from this replica's memory; it stays registered and is
    read again on its next use."""
    state = app_state(request)
    async with _session(request) as s:
        a = await service.get_adapter(s, adapter_id)
    entry = state.models.get(a.base_model)
    unloaded = False
    if entry is not None and state.adapters.is_current(entry.engine, a.name, a.id):
        try:
            unloaded = entry.engine.unload_lora(a.name)
        except LoRAError as exc:
            raise _in_use(a.name, exc) from None
    return {**adapter_json(a, state), "unloaded": unloaded}


@router.delete("/adapters/{adapter_id}")
async def delete_adapter(adapter_id: str, request: Request) -> dict:
    """Off this replica's engine (409 while requests use it), then out of the database;
    other replicas stop serving it within `adapter_cache_ttl_s`."""
    state = app_state(request)
    catalog = state.adapters
    async with _session(request) as s:
        a = await service.get_adapter(s, adapter_id)
        name, entry = a.name, state.models.get(a.base_model)
        catalog.deleting.add(name)
        try:
            if entry is not None:
                try:
                    catalog.remove_stale(entry.engine, name, None)
                except LoRAError as exc:
                    raise _in_use(name, exc) from None
            await service.delete_adapter(s, adapter_id, actor=_actor(request))
            catalog.mark_missing(name)
            catalog.forget_int_id(adapter_id)
        finally:
            catalog.deleting.discard(name)
    return {"id": adapter_id, "object": "adapter", "name": name, "deleted": True}


# -- reports and the engine ------------------------------------------------------------------------------
@router.get("/usage")
async def usage(request: Request):
    tenant_id = request.query_params.get("tenant_id") or None
    if tenant_id is not None:
        async with _session(request) as s:
            # deleted tenants included: their usage rows are kept for billing
            if await s.get(Tenant, tenant_id) is None:
                raise APIError(404, f"tenant {tenant_id!r} not found", param="tenant_id",
                               code="not_found")
    return await usage_response(app_state(request), request, tenant_id)


@router.get("/engine")
async def engine(request: Request) -> dict:
    state = app_state(request)
    out = {}
    for name, stats in state.engine_stats():
        out[name] = {
            "waiting": stats.get("waiting_requests", {}),
            "running": stats.get("running", {}),
            "waiting_by_tenant": stats.get("waiting_by_tenant", {}),
            "running_by_tenant": stats.get("running_by_tenant", {}),
            "kv_blocks": {"total": stats.get("kv_blocks_total"), "used": stats.get("kv_blocks_used"),
                          "free": stats.get("kv_blocks_free")},
            "preemptions": stats.get("num_preemptions", 0),
            "classes": stats.get("classes", {}),
            "tenants": stats.get("tenants", {}),     # per tenant and class, fairness counters too
            "generated_tokens": stats.get("num_generated_tokens", 0),
            "prefix_cache": {"queries": stats.get("prefix_cache_queries", 0),
                             "hits": stats.get("prefix_cache_hits", 0)},
            "lora": stats.get("lora"),     # in_slots, in_cpu, requests, slot_loads, disk_loads
            # the engine's bounded queue: queued per class, bounds, refused / shed per tenant
            "overload": stats.get("overload"),
            # the step-cost model step sizing uses: fitted seconds per unit of each feature,
            # the median relative error of its recent predictions (each made before its step)
            "cost_model": stats.get("cost_model"),
        }
    return {"object": "engine", "models": out, "inflight_requests": len(state.inflight),
            "draining": state.draining}


@router.get("/models")
async def models(request: Request) -> dict:
    """Every served variant: base models with their residency (on the device or offloaded),
    memory, queue and switch counts, and the adapters each engine holds (in a device slot,
    in host memory, or registered and on disk)."""
    state = app_state(request)
    data = []
    for m in state.models.values():
        stats = m.engine.stats() if m.engine.core is not None else {}
        pool = stats.get("model_pool")
        lora = stats.get("lora") or {}
        memory = stats.get("memory", {})
        data.append({
            "id": m.name, "object": "model", "path": str(m.path), "private": m.private,
            "max_model_len": m.engine.max_model_len,
            "resident": pool["resident"] if pool else m.engine.core is not None,
            "memory_bytes": pool["memory_bytes"] if pool else sum(v for k, v in memory.items() if k != "total_bytes"),
            "waiting": sum(stats.get("waiting_requests", {}).values()),
            "running": sum(stats.get("running", {}).values()),
            "loads": pool["loads"] if pool else 1, "offloads": pool["offloads"] if pool else 0,
            "turns": pool["turns"] if pool else 0,
            "pool": stats.get("pool"),
        })
        registered = getattr(m.engine, "loras", {})
        for name, req in registered.items():
            if (req.base_model_name or m.name) != m.name and req.base_model_name is not None:
                continue
            where = ("slot" if name in lora.get("in_slots", {}) else
                     "host" if name in lora.get("in_cpu", []) else "disk")
            data.append({"id": name, "object": "model", "parent": m.name, "residency": where,
                         "requests": lora.get("requests", {}).get(name, 0)})
    return {"object": "list", "data": data}


@router.get("/audit")
async def audit(request: Request, limit: int = Query(100, ge=1, le=1000)) -> JSONResponse:
    async with _session(request) as s:
        rows = await service.list_audit(s, limit=limit)
    return JSONResponse({"object": "list", "data": [
        {"id": r.id, "actor": r.actor, "action": r.action, "target_type": r.target_type,
         "target_id": r.target_id, "detail": r.detail, "created_at": _iso(r.created_at)}
        for r in rows]})
