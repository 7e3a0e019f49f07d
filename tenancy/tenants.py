"""Tenants: creation on a plan, listing, changes, quotas and soft deletion (which revokes the
tenant's keys and deletes its private adapters), each change one audited transaction.

Every mutating function validates, changes, writes an audit entry (actor given by the caller)
and commits; on any error it rolls back and nothing changes. After a rollback the session's
loaded objects are expired: fetch them again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import CursorResult, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy import audit
from lockgate.tenancy.adapters import adapter_detail
from lockgate.tenancy.db import in_transaction, is_unique_violation
from lockgate.tenancy.errors import Conflict, Invalid, NotFound
from lockgate.tenancy.models import (
    DEFAULT_PLAN,
    SERVICE_TIERS,
    TENANT_STATUSES,
    Adapter,
    ApiKey,
    Tenant,
    utcnow,
)
from lockgate.tenancy.quota import Quota, check_price, quota_of, store_quota
from lockgate.tenancy.validation import (
    MODEL_NAME_MAX,
    NAME_MAX,
    check_actor,
    check_list_limit,
    check_name,
    check_quota,
    check_str_list,
    check_text,
)

TENANT_FIELDS = frozenset({"name", "weight", "status", "service_tiers", "default_tier", "models",
                           "cached_input_price", "model_aliases", "speculative"})
MAX_MODEL_ALIASES = 64


# -- checks ------------------------------------------------------------------------------------


def _check_weight(weight: Any) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise Invalid("weight", f"must be a number, got {type(weight).__name__}")
    if not math.isfinite(weight) or weight <= 0:
        raise Invalid("weight", f"must be a finite number > 0, got {weight!r}")
    return float(weight)


def _check_status(status: Any) -> str:
    if status not in TENANT_STATUSES:
        raise Invalid("status", f"must be one of {list(TENANT_STATUSES)}, got {status!r}")
    return status


def _check_tiers(tiers: Any) -> list[str]:
    items = check_str_list(tiers, "service_tiers")
    unknown = [t for t in items if t not in SERVICE_TIERS]
    if unknown:
        raise Invalid("service_tiers", f"unknown tier(s) {unknown}; known: {list(SERVICE_TIERS)}")
    if not items:
        raise Invalid("service_tiers", "must name at least one tier")
    return [t for t in SERVICE_TIERS if t in items]     # canonical order, no duplicates


def _check_default_tier(default_tier: Any, tiers: list[str], field: str) -> str:
    if default_tier not in SERVICE_TIERS:
        raise Invalid("default_tier", f"must be one of {list(SERVICE_TIERS)}, got {default_tier!r}")
    if default_tier not in tiers:
        raise Invalid(field, f"default_tier {default_tier!r} is not in service_tiers {tiers}")
    return default_tier


def _check_models(models: Any) -> list[str] | None:
    if models is None:
        return None
    items = check_str_list(models, "models")
    out: list[str] = []
    for m in items:
        if not m.strip() or len(m) > MODEL_NAME_MAX:
            raise Invalid("models", f"model names must be 1 to {MODEL_NAME_MAX} non-blank "
                                    f"characters, got {m!r}")
        if m not in out:
            out.append(m)
    return out


def _check_price(price: Any) -> float:
    try:
        return check_price(price)
    except ValueError as exc:
        raise Invalid("cached_input_price", str(exc).split(": ", 1)[-1]) from None


def _check_speculative(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid("speculative", f"must be a boolean, got {value!r}")
    return value


def _check_aliases(aliases: Any) -> dict[str, str] | None:
    """A tenant's model aliases: name or `fnmatch` pattern (`claude-*`) -> a served model."""
    if aliases is None:
        return None
    if not isinstance(aliases, dict) or len(aliases) > MAX_MODEL_ALIASES:
        raise Invalid("model_aliases", f"must be an object of at most {MAX_MODEL_ALIASES} names")
    for name, target in aliases.items():
        if not isinstance(name, str) or not 1 <= len(name) <= MODEL_NAME_MAX or "\x00" in name \
                or not isinstance(target, str) or not 1 <= len(target) <= MODEL_NAME_MAX or "\x00" in target:
            raise Invalid("model_aliases", f"names and models must be 1 to {MODEL_NAME_MAX} characters, "
                                           f"got {name!r}: {target!r}")
    return dict(aliases)


def _check_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """The checked values of an `update_tenant` call's changes (known fields only)."""
    for field in changes:
        if field not in TENANT_FIELDS:
            raise Invalid(field, "unknown or read-only tenant field; "
                                 f"known: {sorted(TENANT_FIELDS)}")
    checked: dict[str, Any] = {}
    if "name" in changes:
        checked["name"] = check_name(changes["name"])
    if "weight" in changes:
        checked["weight"] = _check_weight(changes["weight"])
    if "status" in changes:
        checked["status"] = _check_status(changes["status"])
    if "service_tiers" in changes:
        checked["service_tiers"] = _check_tiers(changes["service_tiers"])
    if "default_tier" in changes:
        if changes["default_tier"] not in SERVICE_TIERS:
            raise Invalid("default_tier", f"must be one of {list(SERVICE_TIERS)}, "
                                          f"got {changes['default_tier']!r}")
        checked["default_tier"] = changes["default_tier"]
    if "models" in changes:
        checked["models"] = _check_models(changes["models"])
    if "cached_input_price" in changes:
        checked["cached_input_price"] = _check_price(changes["cached_input_price"])
    if "model_aliases" in changes:
        checked["model_aliases"] = _check_aliases(changes["model_aliases"])
    if "speculative" in changes:
        checked["speculative"] = _check_speculative(changes["speculative"])
    return checked


def tenant_quota(t: Tenant) -> Quota:
    """The quota stored on a tenant."""
    return quota_of(t)


# -- reads -------------------------------------------------------------------------------------


async def tenant_for_update(session: AsyncSession, tenant_id: str) -> Tenant:
    """The live tenant, read again from the database (for a change); NotFound otherwise."""
    tenant = await session.get(Tenant, check_text(tenant_id, "tenant_id"), populate_existing=True)
    if tenant is None or tenant.deleted_at is not None:
        raise NotFound("tenant", tenant_id)
    return tenant


async def _name_taken(session: AsyncSession, name: str, exclude_id: str | None = None) -> None:
    stmt = select(Tenant.id, Tenant.deleted_at).where(Tenant.name == name)
    if exclude_id is not None:
        stmt = stmt.where(Tenant.id != exclude_id)
    row = (await session.execute(stmt)).first()
    if row is not None:
        note = " (by a deleted tenant; names are not reused)" if row.deleted_at else ""
        raise Conflict("name", f"a tenant named {name!r} already exists{note}")


async def list_tenants(session: AsyncSession, *, limit: int = 50, after: str | None = None,
                       name_contains: str | None = None) -> list[Tenant]:
    """Live tenants ordered by id; pass the last id seen as `after` for the next page;
    `name_contains`: only those whose name holds it, in any case."""
    check_list_limit(limit)
    if after is not None:
        check_text(after, "after")
    stmt = select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.id).limit(limit)
    if after is not None:
        stmt = stmt.where(Tenant.id > after)
    if name_contains:
        needle = check_text(name_contains, "name")[:NAME_MAX].lower()
        stmt = stmt.where(func.lower(Tenant.name).contains(needle, autoescape=True))
    return list((await session.scalars(stmt)).all())


async def get_tenant(session: AsyncSession, tenant_id: str) -> Tenant:
    """The tenant; NotFound if it does not exist or is deleted."""
    tenant = await session.get(Tenant, check_text(tenant_id, "tenant_id"))
    if tenant is None or tenant.deleted_at is not None:
        raise NotFound("tenant", tenant_id)
    return tenant


# -- changes -----------------------------------------------------------------------------------


async def create_tenant(
    session: AsyncSession,
    *,
    name: str,
    weight: float = 1.0,
    service_tiers: Sequence[str] | None = None,
    default_tier: str | None = None,
    models: Sequence[str] | None = None,
    quota: Quota | None = None,
    status: str = "active",
    cached_input_price: float = 1.0,
    model_aliases: dict[str, str] | None = None,
    speculative: bool = True,
    actor: str,
) -> Tenant:
    """Create a tenant. Conflict if the name is taken (deleted tenants included). Without
    `service_tiers` its plan is `DEFAULT_PLAN` (default and flex; priority is granted
    explicitly)."""
    check_actor(actor)
    name = check_name(name)
    weight = _check_weight(weight)
    status = _check_status(status)
    tiers = list(DEFAULT_PLAN) if service_tiers is None else _check_tiers(service_tiers)
    if default_tier is None:
        if "default" not in tiers:
            raise Invalid("default_tier", f"required when service_tiers {tiers} lacks 'default'")
        default_tier = "default"
    default_tier = _check_default_tier(default_tier, tiers, "default_tier")
    model_list = _check_models(models)
    q = check_quota(quota)
    price = _check_price(cached_input_price)
    aliases = _check_aliases(model_aliases)
    speculative = _check_speculative(speculative)

    async def work() -> Tenant:
        await _name_taken(session, name)
        now = utcnow()
        tenant = Tenant(name=name, weight=weight, status=status, service_tiers=tiers,
                        default_tier=default_tier, models=model_list, cached_input_price=price,
                        model_aliases=aliases, speculative=speculative, created_at=now, updated_at=now)
        store_quota(tenant, q)
        session.add(tenant)
        await session.flush()
        audit.record(session, actor, "tenant.create", "tenant", tenant.id, {
            "name": name, "weight": weight, "status": status, "service_tiers": tiers,
            "default_tier": default_tier, "models": model_list, "quota": q.to_dict(),
            "cached_input_price": price, "model_aliases": aliases, "speculative": speculative,
        })
        return tenant

    try:
        return await in_transaction(session, work)
    except IntegrityError as exc:
        if is_unique_violation(exc, "name"):
            raise Conflict("name", f"a tenant named {name!r} already exists") from None
        raise


async def update_tenant(session: AsyncSession, tenant_id: str, *, actor: str,
                        **changes: Any) -> Tenant:
    """Change name/weight/status/service_tiers/default_tier/models/cached_input_price/
    model_aliases/speculative of a live tenant."""
    check_actor(actor)
    checked = _check_changes(changes)

    async def work() -> Tenant:
        tenant = await tenant_for_update(session, tenant_id)
        tiers = checked.get("service_tiers", tenant.service_tiers)
        default = checked.get("default_tier", tenant.default_tier)
        _check_default_tier(default, tiers,
                            "default_tier" if "default_tier" in checked else "service_tiers")
        if "name" in checked and checked["name"] != tenant.name:
            await _name_taken(session, checked["name"], exclude_id=tenant.id)
        before = {f: getattr(tenant, f) for f in checked}
        for f, v in checked.items():
            setattr(tenant, f, v)
        tenant.updated_at = utcnow()
        audit.record(session, actor, "tenant.update", "tenant", tenant.id,
                     {"before": before, "after": checked})
        await session.flush()
        return tenant

    try:
        return await in_transaction(session, work)
    except IntegrityError as exc:
        if is_unique_violation(exc, "name"):
            taken = checked.get("name")
            raise Conflict("name", f"a tenant named {taken!r} already exists") from None
        raise


async def delete_tenant(session: AsyncSession, tenant_id: str, *, actor: str) -> Tenant:
    """Soft-delete a tenant, revoke its keys and delete its private adapters' rows (nobody
    else may use them; their names become free); its usage records stay. One transaction."""
    check_actor(actor)

    async def work() -> Tenant:
        tenant = await tenant_for_update(session, tenant_id)
        now = utcnow()
        tenant.deleted_at = now
        tenant.updated_at = now
        revoked = cast("CursorResult[Any]", await session.execute(
            update(ApiKey)
            .where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=now)
            .execution_options(synchronize_session="fetch")
        ))
        owned = list((await session.scalars(
            select(Adapter).where(Adapter.owner_tenant_id == tenant.id).order_by(Adapter.name)
        )).all())
        for a in owned:
            audit.record(session, actor, "adapter.delete", "adapter", a.id,
                         {**adapter_detail(a), "with": "tenant.delete"})
            await session.delete(a)
        audit.record(session, actor, "tenant.delete", "tenant", tenant.id,
                     {"name": tenant.name, "revoked_keys": revoked.rowcount,
                      "deleted_adapters": [a.name for a in owned]})
        await session.flush()
        return tenant

    return await in_transaction(session, work)


async def set_quota(session: AsyncSession, tenant_id: str, quota: Quota, *,
                    actor: str) -> Tenant:
    """Replace a tenant's quota (None fields: unlimited)."""
    check_actor(actor)
    q = check_quota(quota)

    async def work() -> Tenant:
        tenant = await tenant_for_update(session, tenant_id)
        before = tenant_quota(tenant).to_dict()
        store_quota(tenant, q)
        tenant.updated_at = utcnow()
        audit.record(session, actor, "tenant.set_quota", "tenant", tenant.id,
                     {"before": before, "after": q.to_dict()})
        await session.flush()
        return tenant

    return await in_transaction(session, work)
