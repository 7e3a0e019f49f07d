"""What the admin side does, once: tenants (create, change, delete, quota, a page of them),
keys (a tenant's, admin and viewer keys, revoking one), the engines' state, the served models
with their adapters (registering and unloading one) and the audit log.
The /admin/v1 routes (gateway/admin/) and the console's pages (gateway/console/) both call
these, after the same authorization (`caller.may`), so neither can do what the other refuses.

Each function takes the app's state and an open session; refusals are `APIError`s (or
tenancy's errors, which `deps.open_session` and the console answer alike)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from lockgate.engine import AdapterInUse, EngineStats, LoRAError
from lockgate.gateway.adapter_catalog import AdapterRefused
from lockgate.gateway.errors import APIError
from lockgate.gateway.schemas import (
    AdapterCreate,
    AdapterPublic,
    AdapterUnloadedPublic,
    AdminKeyCreate,
    KeyCreate,
    QuotaBody,
    TenantCreate,
    TenantPatch,
)
from lockgate.gateway.state import AppState
from lockgate.gateway.usage_api import parse_limit, parse_time
from lockgate.tenancy import adapters, api_keys, tenants
from lockgate.tenancy.audit import audit_page

logger = logging.getLogger(__name__)


# -- tenants ------------------------------------------------------------------------------------------
def after_tenant_change(state: AppState, t: Any) -> None:
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


async def create_tenant(state: AppState, session: Any, body: TenantCreate, *, actor: str) -> Any:
    await check_model_names(state, session, body.models)
    check_alias_targets(state, body.model_aliases)
    t = await tenants.create_tenant(
        session, name=body.name, weight=body.weight, service_tiers=body.service_tiers,
        default_tier=body.default_tier, models=body.models, status=body.status,
        quota=body.quota.quota() if body.quota else None, cached_input_price=body.cached_input_price,
        model_aliases=body.model_aliases, speculative=body.speculative, actor=actor)
    after_tenant_change(state, t)
    return t


async def tenant_page(session: Any, *, limit: int, after: str | None,
                      name: str | None = None) -> tuple[list[Any], bool]:
    """Live tenants by id, `limit` after `after`, whose name holds `name` (any case): the
    page and whether more follow."""
    rows = await tenants.list_tenants(session, limit=limit + 1, after=after, name_contains=name)
    return rows[:limit], len(rows) > limit


async def update_tenant(state: AppState, session: Any, tenant_id: str, body: TenantPatch, *,
                        actor: str) -> Any:
    changes = body.model_dump(exclude_unset=True)
    if not changes:
        raise APIError(400, "the body changes nothing; give at least one field")
    for name in ("name", "weight", "status", "service_tiers", "default_tier", "cached_input_price", "speculative"):
        if name in changes and changes[name] is None:
            raise APIError(400, f"{name}: may not be null", param=name)
    await check_model_names(state, session, changes.get("models"))
    check_alias_targets(state, changes.get("model_aliases"))
    t = await tenants.update_tenant(session, tenant_id, actor=actor, **changes)
    after_tenant_change(state, t)
    return t


async def delete_tenant(state: AppState, session: Any, tenant_id: str, *, actor: str) -> None:
    """Soft delete: keys revoked, private adapters deleted (off this replica's engines now,
    unless a request still uses one: then at the next sweep, as on other replicas)."""
    await tenants.delete_tenant(session, tenant_id, actor=actor)
    state.auth.keys.invalidate_tenant(tenant_id)
    for m in state.models.entries.values():   # its cached prefixes, both KV tiers
        m.engine.purge_tenant(tenant_id)
    try:
        await state.models.adapters.sweep()
    except Exception:  # any failure, logged: the periodic sweep tries again; the rows are gone
        logger.warning("adapter sweep after deleting tenant %s failed", tenant_id, exc_info=True)


async def set_quota(state: AppState, session: Any, tenant_id: str, body: QuotaBody, *, actor: str) -> Any:
    t = await tenants.set_quota(session, tenant_id, body.quota(), actor=actor)
    after_tenant_change(state, t)
    return t


# -- keys ---------------------------------------------------------------------------------------------
async def create_tenant_key(state: AppState, session: Any, tenant_id: str, body: KeyCreate, *,
                            actor: str) -> tuple[Any, str]:
    """A tenant's key: (row, plaintext shown once)."""
    await tenants.get_tenant(session, tenant_id)
    k, plaintext = await api_keys.create_key(
        session, tenant_id=tenant_id, name=body.name, scopes=tuple(body.scopes or ("inference",)),
        expires_at=body.expires_at, quota=body.quota.quota() if body.quota else None,
        pepper=state.pepper, actor=actor)
    state.auth.keys.forget_missing(k.prefix)      # a miss of its prefix, seen before, ends now
    return k, plaintext


async def create_admin_key(state: AppState, session: Any, body: AdminKeyCreate, *,
                           actor: str) -> tuple[Any, str]:
    """An admin key, or a viewer key (`scopes: ["viewer"]`): (row, plaintext shown once)."""
    k, plaintext = await api_keys.create_key(
        session, tenant_id=None, name=body.name, scopes=tuple(body.scopes if body.scopes is not None else ("admin",)),
        expires_at=body.expires_at, pepper=state.pepper, actor=actor)
    state.auth.keys.forget_missing(k.prefix)
    return k, plaintext


async def revoke_key(state: AppState, session: Any, key_id: str, *, actor: str) -> None:
    """Revoked (and its console sessions ended); this replica's cached principal forgotten,
    the others' within their key cache's ttl."""
    await api_keys.revoke_key(session, key_id, actor=actor)
    state.auth.keys.invalidate_key_id(key_id)


# -- the engines --------------------------------------------------------------------------------------
def _json(part: Any) -> dict | None:
    return asdict(part) if part is not None else None


def engine_json(s: EngineStats) -> dict:
    """One model's engine as /admin/v1/engine shows it."""
    return {
        "waiting": s.waiting_requests,
        "running": s.running,
        "waiting_by_tenant": s.waiting_by_tenant,
        "running_by_tenant": s.running_by_tenant,
        "kv_blocks": {"total": s.kv.total, "used": s.kv.used, "free": s.kv.free},
        "preemptions": s.num_preemptions,
        "classes": {c: asdict(q) for c, q in s.classes.items()},
        # per tenant and class, fairness counters too
        "tenants": {t: {c: asdict(row) for c, row in by_class.items()} for t, by_class in s.tenants.items()},
        "generated_tokens": s.num_generated_tokens,
        "prefix_cache": {"queries": s.kv.prefix_cache_queries, "hits": s.kv.prefix_cache_hits},
        # the KV tiers: blocks held and room, hits (tokens), copies and evictions (blocks)
        "kv_tiers": {
            "device": {"blocks": s.kv.used, "capacity": s.kv.total, "evictions": s.kv.device_evictions,
                       "hits": s.kv.device_hits},
            "host": {"blocks": s.kv.host_held, "capacity": s.kv.host_total, "hits": s.kv.host_hits,
                     "queries": s.kv.host_queries, "copy_ins": s.kv.host_copy_ins,
                     "stores": s.kv.host_stores, "evictions": s.kv.host_evictions}},
        "lora": _json(s.lora),     # in_slots, in_cpu, requests, slot_loads, disk_loads
        # the engine's bounded queue: queued per class, bounds, refused / shed per tenant
        "overload": _json(s.overload),
        # the step-cost model step sizing uses: fitted seconds per unit of each feature,
        # the median relative error of its recent predictions (each made before its step)
        "cost_model": _json(s.cost_model),
        # a model split over ranks: its size, communication, each rank's memory, rebuilds
        "tensor_parallel": _json(s.parallel),
        # speculative decoding: its settings, drafts verified and tokens kept (in all, by draft
        # position, per class), and per class whether it drafts now (engine/spec/switch.py)
        "speculative": _json(s.spec),
        # intra-op threads: now, the full width, the cores other processes took (engine/threads.py)
        "threads": _json(s.threads),
        # served by a Ray pool: each worker's own, in this same shape (the fields above are
        # their sum); one engine in this process: none
        "workers": {w: engine_json(part) for w, part in s.by_worker.items()},
    }


def engine_snapshot(state: AppState) -> dict:
    """What /admin/v1/engine answers: every model's engine, the requests in flight here."""
    models = {name: engine_json(stats) for name, stats in state.models.engine_stats()}
    return {"object": "engine", "models": models, "inflight_requests": len(state.inflight),
            "draining": state.draining}


def _model_row(m: Any, stats: EngineStats) -> dict:
    """A base model as /admin/v1/models lists it: residency, memory, queue and switches."""
    if not m.engine.is_ready:
        stats = EngineStats()
    own = stats.residency
    return {
        "id": m.name, "object": "model", "path": str(m.path), "private": m.private,
        "max_model_len": m.info.max_model_len,
        "resident": own.resident if own else m.engine.is_ready,
        "memory_bytes": own.memory_bytes if own else sum(v for k, v in stats.memory.items() if k != "total_bytes"),
        "waiting": sum(stats.waiting_requests.values()),
        "running": sum(stats.running.values()),
        "loads": own.loads if own else 1, "offloads": own.offloads if own else 0,
        "turns": own.turns if own else 0,
        "pool": {"memory": stats.pool.memory, "switches": stats.pool.switches,
                 "switch_s": stats.pool.switch_s, "current_model": stats.pool.current_model}
        if stats.pool else None,
    }


def models_listing(state: AppState) -> dict:
    """What /admin/v1/models answers: every served variant, base models with their residency
    (on the device or offloaded), memory, queue and switch counts, and the adapters each
    engine holds (in a device slot, in host memory, or registered and on disk); under a Ray
    pool, its workers and the placement's decisions with their reasons (`pool`)."""
    data = []
    pool = None
    for m in state.models.values():
        stats = m.engine.stats()
        if stats.workers is not None:     # a Ray pool's workers, placement and its reasons, ready or not
            pool = asdict(stats.workers)
        data.append(_model_row(m, stats))
        lora = stats.lora if m.engine.is_ready else None
        for name, req in m.engine.loras.items():
            if (req.base_model_name or m.name) != m.name and req.base_model_name is not None:
                continue
            where = ("slot" if lora and name in lora.in_slots else
                     "host" if lora and name in lora.in_cpu else "disk")
            data.append({"id": name, "object": "model", "parent": m.name, "residency": where,
                         "requests": lora.requests.get(name, 0) if lora else 0})
    return {"object": "list", "data": data, "pool": pool}


# -- adapters -----------------------------------------------------------------------------------------
def adapter_registered(a: Any, state: AppState) -> bool:
    """Whether this replica's engine serves the adapter row `a` now."""
    entry = state.models.get(a.base_model)
    return entry is not None and state.models.adapters.is_current(entry.engine, a.name, a.id)


def adapter_public(a: Any, state: AppState) -> AdapterPublic:
    return AdapterPublic.from_row(a, registered=adapter_registered(a, state))


def _lora_error(exc: LoRAError, body: AdapterCreate) -> APIError:
    """The engine's refusal as a 400 naming the request's field it is about."""
    msg = str(exc)
    if exc.field == "lora_name":
        return APIError(400, f"name: {msg}", param="name")
    if exc.field == "base_model_name":
        return APIError(400, f"base_model: the adapter in {body.path!r} does not fit "
                        f"{body.base_model!r}: {msg}", param="base_model")
    return APIError(400, f"path: the adapter in {body.path!r} cannot be served: {msg}", param="path")


def in_use_error(exc: LoRAError, name: str) -> APIError:
    return APIError(409, f"adapter {name!r} is in use by requests on this replica; retry when "
                    f"they have finished ({exc})", code="adapter_in_use")


async def register_adapter(state: AppState, session: Any, body: AdapterCreate, *, actor: str) -> AdapterPublic:
    """Check the names here, then let the catalog register it (engine first, then the row)."""
    if body.name in state.models:
        raise APIError(400, f"name: {body.name!r} is a served model's name", param="name")
    base = state.models.get(body.base_model)
    if base is None:
        raise APIError(400, f"base_model: {body.base_model!r} is not served here (served: "
                       f"{', '.join(sorted(state.models))})", param="base_model")
    try:
        row = await state.models.adapters.create(session, base, name=body.name, path=body.path,
                                                 owner_tenant_id=body.owner_tenant_id, actor=actor)
    except AdapterInUse as exc:
        raise in_use_error(exc, body.name) from None
    except AdapterRefused as exc:
        raise _lora_error(exc.cause, body) from None
    return adapter_public(row, state)


async def unload_adapter(state: AppState, session: Any, adapter_id: str) -> AdapterUnloadedPublic:
    """Drop the adapter's weights from this replica's memory; it stays registered and is
    read again on its next use (409 while requests use it)."""
    a = await adapters.get_adapter(session, adapter_id)
    entry = state.models.get(a.base_model)
    unloaded = False
    if entry is not None and state.models.adapters.is_current(entry.engine, a.name, a.id):
        try:
            unloaded = entry.engine.unload_lora(a.name)
        except LoRAError as exc:
            raise in_use_error(exc, a.name) from None
    return AdapterUnloadedPublic.from_row(a, registered=adapter_registered(a, state), unloaded=unloaded)


# -- the audit log ------------------------------------------------------------------------------------
AUDIT_QUERY = {"limit", "after", "action", "target_type", "target_id", "actor", "start", "end"}


async def audit_listing(session: Any, q: Mapping[str, str]) -> tuple[list[Any], bool]:
    """A page of the audit log as the query `q` asks (`AUDIT_QUERY`; any other name is a 400):
    the newest first, `limit` (100, at most 1000) after the cursor `after`, filtered."""
    unknown = sorted(set(q) - AUDIT_QUERY)
    if unknown:
        raise APIError(400, f"{unknown[0]}: unknown query parameter (known: "
                       f"{', '.join(sorted(AUDIT_QUERY))})", param=unknown[0])
    limit = parse_limit(q.get("limit"), default=100)
    after = q.get("after") or None
    if after is not None and not (after.isdigit() and len(after) <= 18):
        raise APIError(400, "after: not a cursor of this listing (the last_id of a page)", param="after")
    start, end = parse_time(q.get("start"), "start"), parse_time(q.get("end"), "end")
    return await audit_page(
        session, limit, before_id=int(after) if after else None, action=q.get("action") or None,
        target_type=q.get("target_type") or None, target_id=q.get("target_id") or None,
        actor=q.get("actor") or None, start=start, end=end)
