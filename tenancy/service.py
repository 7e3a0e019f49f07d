"""Tenants, API keys, adapters, authentication, usage and audit: plain async functions over a
session.

Every mutating function runs as one transaction: it validates, changes, writes an
`AuditEntry` (actor given by the caller) and commits; on any error it rolls back and nothing
changes. After a rollback the session's loaded objects are expired: fetch them again.
`touch_key` and `UsageWriter` are bookkeeping on the request path and write no audit entry.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import (
    Date,
    and_,
    case,
    cast,
    func,
    insert,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from tenancy import keys
from tenancy.errors import AuthError, Conflict, Invalid, NotFound
from tenancy.models import (
    DEFAULT_PLAN,
    SCOPES,
    SERVICE_TIERS,
    TENANT_STATUSES,
    USAGE_STATUSES,
    Adapter,
    ApiKey,
    AuditEntry,
    Tenant,
    UsageRecord,
    new_adapter_id,
    utcnow,
)
from tenancy.quota import QUOTA_FIELDS, Quota

T = TypeVar("T")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 64
KEY_NAME_MAX = 64
MODEL_NAME_MAX = 128
MAX_LIST_LIMIT = 1000
TENANT_FIELDS = frozenset({"name", "weight", "status", "service_tiers", "default_tier", "models"})
GROUP_BY = (None, "day", "model", "service_tier")
# A presented key: "lg-", then at least a lookup prefix and some secret, no whitespace.
_KEY_RE = re.compile(r"^lg-[\x21-\x7e]{%d,253}$" % (keys.LOOKUP_PREFIX_LEN + 8))
_MIN_ADMIN_SECRET = 32     # characters after "lg-" in a bootstrap admin key


# -- helpers -----------------------------------------------------------------------------------


async def _in_transaction(session: AsyncSession, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` then commit; roll everything back on any error."""
    try:
        result = await work()
        await session.commit()
    except BaseException:
        await session.rollback()
        raise
    return result


def _audit(session: AsyncSession, actor: str, action: str, target_type: str,
           target_id: str | None, detail: dict[str, Any] | None = None) -> None:
    session.add(AuditEntry(actor=actor, action=action, target_type=target_type,
                           target_id=target_id, detail=detail, created_at=utcnow()))


def _check_actor(actor: Any) -> str:
    if not isinstance(actor, str) or not actor.strip() or len(actor) > 64:
        raise Invalid("actor", "must be a non-empty string of at most 64 characters")
    return actor


def _as_utc(value: Any, field: str) -> datetime | None:
    """An aware UTC datetime (naive input is taken to be UTC), or None."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise Invalid(field, f"must be a datetime, got {type(value).__name__}")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise Invalid("name", f"must be a string, got {type(name).__name__}")
    if not 1 <= len(name) <= NAME_MAX:
        raise Invalid("name", f"must be 1 to {NAME_MAX} characters, got {len(name)}")
    if not NAME_RE.match(name):
        raise Invalid("name", f"{name!r} must match {NAME_RE.pattern} "
                              "(letters, digits, '.', '_', '-'; starting with a letter or digit)")
    return name


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


def _check_str_list(value: Any, field: str) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise Invalid(field, f"must be a list of strings, got {type(value).__name__}")
    items = list(value)
    for item in items:
        if not isinstance(item, str):
            raise Invalid(field, f"must be a list of strings; found {item!r}")
    return items


def _check_tiers(tiers: Any) -> list[str]:
    items = _check_str_list(tiers, "service_tiers")
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
    items = _check_str_list(models, "models")
    out: list[str] = []
    for m in items:
        if not m.strip() or len(m) > MODEL_NAME_MAX:
            raise Invalid("models", f"model names must be 1 to {MODEL_NAME_MAX} non-blank "
                                    f"characters, got {m!r}")
        if m not in out:
            out.append(m)
    return out


def _check_quota(quota: Any) -> Quota:
    if quota is None:
        return Quota()
    if isinstance(quota, Quota):
        return quota
    if isinstance(quota, dict):
        try:
            return Quota.from_dict(quota)
        except (TypeError, ValueError) as exc:
            raise Invalid("quota", str(exc)) from None
    raise Invalid("quota", f"must be a Quota, a dict or null, got {type(quota).__name__}")


def _apply_quota(row: Tenant | ApiKey, quota: Quota) -> None:
    for name in QUOTA_FIELDS:
        setattr(row, name, getattr(quota, name))


def tenant_quota(t: Tenant) -> Quota:
    """The quota stored on a tenant."""
    return Quota(**{name: getattr(t, name) for name in QUOTA_FIELDS})


def key_quota(k: ApiKey) -> Quota:
    """The quota stored on an API key."""
    return Quota(**{name: getattr(k, name) for name in QUOTA_FIELDS})


def _is_unique_violation(exc: IntegrityError, column: str) -> bool:
    text = str(exc.orig).lower()
    return column in text and ("unique" in text or "duplicate" in text)


# -- tenants -----------------------------------------------------------------------------------


async def _tenant_for_update(session: AsyncSession, tenant_id: str) -> Tenant:
    tenant = await session.get(Tenant, tenant_id, populate_existing=True)
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
    actor: str,
) -> Tenant:
    """Create a tenant. Conflict if the name is taken (deleted tenants included). Without
    `service_tiers` its plan is `DEFAULT_PLAN` (default and flex; priority is granted
    explicitly)."""
    _check_actor(actor)
    name = _check_name(name)
    weight = _check_weight(weight)
    status = _check_status(status)
    tiers = list(DEFAULT_PLAN) if service_tiers is None else _check_tiers(service_tiers)
    if default_tier is None:
        if "default" not in tiers:
            raise Invalid("default_tier", f"required when service_tiers {tiers} lacks 'default'")
        default_tier = "default"
    default_tier = _check_default_tier(default_tier, tiers, "default_tier")
    model_list = _check_models(models)
    q = _check_quota(quota)

    async def work() -> Tenant:
        await _name_taken(session, name)
        now = utcnow()
        tenant = Tenant(name=name, weight=weight, status=status, service_tiers=tiers,
                        default_tier=default_tier, models=model_list,
                        created_at=now, updated_at=now)
        _apply_quota(tenant, q)
        session.add(tenant)
        await session.flush()
        _audit(session, actor, "tenant.create", "tenant", tenant.id, {
            "name": name, "weight": weight, "status": status, "service_tiers": tiers,
            "default_tier": default_tier, "models": model_list, "quota": q.to_dict(),
        })
        return tenant

    try:
        return await _in_transaction(session, work)
    except IntegrityError as exc:
        if _is_unique_violation(exc, "name"):
            raise Conflict("name", f"a tenant named {name!r} already exists") from None
        raise


async def list_tenants(session: AsyncSession, *, limit: int = 50,
                       after: str | None = None) -> list[Tenant]:
    """Live tenants ordered by id; pass the last id seen as `after` for the next page."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise Invalid("limit", f"must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r}")
    if after is not None and not isinstance(after, str):
        raise Invalid("after", "must be a tenant id")
    stmt = select(Tenant).where(Tenant.deleted_at.is_(None)).order_by(Tenant.id).limit(limit)
    if after is not None:
        stmt = stmt.where(Tenant.id > after)
    return list((await session.scalars(stmt)).all())


async def get_tenant(session: AsyncSession, tenant_id: str) -> Tenant:
    """The tenant; NotFound if it does not exist or is deleted."""
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None or tenant.deleted_at is not None:
        raise NotFound("tenant", tenant_id)
    return tenant


async def update_tenant(session: AsyncSession, tenant_id: str, *, actor: str,
                        **changes: Any) -> Tenant:
    """Change name/weight/status/service_tiers/default_tier/models of a live tenant."""
    _check_actor(actor)
    for field in changes:
        if field not in TENANT_FIELDS:
            raise Invalid(field, "unknown or read-only tenant field; "
                                 f"known: {sorted(TENANT_FIELDS)}")
    checked: dict[str, Any] = {}
    if "name" in changes:
        checked["name"] = _check_name(changes["name"])
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

    async def work() -> Tenant:
        tenant = await _tenant_for_update(session, tenant_id)
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
        _audit(session, actor, "tenant.update", "tenant", tenant.id,
               {"before": before, "after": checked})
        await session.flush()
        return tenant

    try:
        return await _in_transaction(session, work)
    except IntegrityError as exc:
        if _is_unique_violation(exc, "name"):
            taken = checked.get("name")
            raise Conflict("name", f"a tenant named {taken!r} already exists") from None
        raise


async def delete_tenant(session: AsyncSession, tenant_id: str, *, actor: str) -> Tenant:
    """Soft-delete a tenant, revoke its keys and delete its private adapters' rows (nobody
    else may use them; their names become free); its usage records stay. One transaction."""
    _check_actor(actor)

    async def work() -> Tenant:
        tenant = await _tenant_for_update(session, tenant_id)
        now = utcnow()
        tenant.deleted_at = now
        tenant.updated_at = now
        revoked = await session.execute(
            update(ApiKey)
            .where(ApiKey.tenant_id == tenant.id, ApiKey.revoked_at.is_(None))
            .values(revoked_at=now)
            .execution_options(synchronize_session="fetch")
        )
        owned = list((await session.scalars(
            select(Adapter).where(Adapter.owner_tenant_id == tenant.id).order_by(Adapter.name)
        )).all())
        for a in owned:
            _audit(session, actor, "adapter.delete", "adapter", a.id,
                   {**_adapter_detail(a), "with": "tenant.delete"})
            await session.delete(a)
        _audit(session, actor, "tenant.delete", "tenant", tenant.id,
               {"name": tenant.name, "revoked_keys": revoked.rowcount,
                "deleted_adapters": [a.name for a in owned]})
        await session.flush()
        return tenant

    return await _in_transaction(session, work)


async def set_quota(session: AsyncSession, tenant_id: str, quota: Quota, *,
                    actor: str) -> Tenant:
    """Replace a tenant's quota (None fields: unlimited)."""
    _check_actor(actor)
    q = _check_quota(quota)

    async def work() -> Tenant:
        tenant = await _tenant_for_update(session, tenant_id)
        before = tenant_quota(tenant).to_dict()
        _apply_quota(tenant, q)
        tenant.updated_at = utcnow()
        _audit(session, actor, "tenant.set_quota", "tenant", tenant.id,
               {"before": before, "after": q.to_dict()})
        await session.flush()
        return tenant

    return await _in_transaction(session, work)


# -- keys --------------------------------------------------------------------------------------


def _check_key_name(name: Any) -> str:
    if not isinstance(name, str):
        raise Invalid("name", f"must be a string, got {type(name).__name__}")
    if not name.strip() or len(name) > KEY_NAME_MAX:
        raise Invalid("name", f"must be 1 to {KEY_NAME_MAX} characters, not blank")
    if any(not ch.isprintable() for ch in name):
        raise Invalid("name", "must not contain control characters")
    return name


def _check_scopes(scopes: Any) -> list[str]:
    items = _check_str_list(scopes, "scopes")
    unknown = [s for s in items if s not in SCOPES]
    if unknown:
        raise Invalid("scopes", f"unknown scope(s) {unknown}; known: {list(SCOPES)}")
    if not items:
        raise Invalid("scopes", "must name at least one scope")
    return [s for s in SCOPES if s in items]


def _check_pepper(pepper: Any) -> bytes:
    if not isinstance(pepper, (bytes, bytearray)) or not pepper:
        raise Invalid("pepper", "must be non-empty bytes")
    return bytes(pepper)


async def create_key(
    session: AsyncSession,
    *,
    tenant_id: str | None,
    name: str,
    scopes: Sequence[str] = ("inference",),
    expires_at: datetime | None = None,
    quota: Quota | None = None,
    pepper: bytes,
    actor: str,
) -> tuple[ApiKey, str]:
    """Create a key; returns (row, plaintext). The plaintext is not stored and shown once.

    Tenant keys have scope "inference" only; a key without tenant is an admin key and has
    exactly the scope "admin"."""
    _check_actor(actor)
    name = _check_key_name(name)
    scope_list = _check_scopes(scopes)
    if tenant_id is not None:
        if not isinstance(tenant_id, str):
            raise Invalid("tenant_id", "must be a tenant id or null")
        if "admin" in scope_list:
            raise Invalid("scopes", "a tenant key cannot have the 'admin' scope; "
                                    "admin keys have tenant_id null")
    elif scope_list != ["admin"]:
        raise Invalid("tenant_id", "required for an 'inference' key; a key without a tenant "
                                   "is an admin key with scopes ['admin']")
    expires = _as_utc(expires_at, "expires_at")
    if expires is not None and expires <= utcnow():
        raise Invalid("expires_at", f"{expires.isoformat()} is in the past")
    q = _check_quota(quota)
    pepper = _check_pepper(pepper)

    async def work() -> tuple[ApiKey, str]:
        if tenant_id is not None:
            await _tenant_for_update(session, tenant_id)
        for _ in range(5):   # a prefix collision is astronomically rare; retry anyway
            plaintext, prefix = keys.generate_key()
            clash = await session.scalar(select(ApiKey.id).where(ApiKey.prefix == prefix))
            if clash is None:
                break
        else:  # pragma: no cover
            raise Conflict("prefix", "could not generate a unique key prefix")
        key = ApiKey(tenant_id=tenant_id, name=name, prefix=prefix,
                     secret_hash=keys.hash_secret(plaintext, pepper), scopes=scope_list,
                     created_at=utcnow(), expires_at=expires)
        _apply_quota(key, q)
        session.add(key)
        await session.flush()
        _audit(session, actor, "key.create", "key", key.id, {
            "tenant_id": tenant_id, "name": name, "scopes": scope_list, "prefix": prefix,
            "expires_at": expires.isoformat() if expires else None, "quota": q.to_dict(),
        })
        return key, plaintext

    return await _in_transaction(session, work)


async def list_keys(session: AsyncSession, tenant_id: str | None) -> list[ApiKey]:
    """A live tenant's keys (revoked ones included), or the admin keys for tenant_id None."""
    if tenant_id is None:
        cond = ApiKey.tenant_id.is_(None)
    else:
        await get_tenant(session, tenant_id)
        cond = ApiKey.tenant_id == tenant_id
    stmt = select(ApiKey).where(cond).order_by(ApiKey.created_at, ApiKey.id)
    return list((await session.scalars(stmt)).all())


async def get_key(session: AsyncSession, key_id: str) -> ApiKey:
    """The key (revoked or not); NotFound if no such id."""
    key = await session.get(ApiKey, key_id)
    if key is None:
        raise NotFound("key", key_id)
    return key


async def revoke_key(session: AsyncSession, key_id: str, *, actor: str) -> ApiKey:
    """Revoke a key; revoking a revoked key changes nothing."""
    _check_actor(actor)

    async def work() -> ApiKey:
        key = await session.get(ApiKey, key_id, populate_existing=True)
        if key is None:
            raise NotFound("key", key_id)
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            _audit(session, actor, "key.revoke", "key", key.id,
                   {"tenant_id": key.tenant_id, "name": key.name})
            await session.flush()
        return key

    return await _in_transaction(session, work)


async def set_key_quota(session: AsyncSession, key_id: str, quota: Quota, *,
                        actor: str) -> ApiKey:
    """Replace a key's own quota (on top of its tenant's)."""
    _check_actor(actor)
    q = _check_quota(quota)

    async def work() -> ApiKey:
        key = await session.get(ApiKey, key_id, populate_existing=True)
        if key is None:
            raise NotFound("key", key_id)
        before = key_quota(key).to_dict()
        _apply_quota(key, q)
        _audit(session, actor, "key.set_quota", "key", key.id,
               {"before": before, "after": q.to_dict()})
        await session.flush()
        return key

    return await _in_transaction(session, work)


async def touch_key(session: AsyncSession, key_id: str, when: datetime) -> None:
    """Record the key's last use (never moves backwards). No audit entry."""
    when_utc = _as_utc(when, "when")

    async def work() -> None:
        await session.execute(
            update(ApiKey)
            .where(ApiKey.id == key_id,
                   or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < when_utc))
            .values(last_used_at=when_utc)
            .execution_options(synchronize_session=False)
        )

    await _in_transaction(session, work)


# -- authentication ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a valid key speaks for: everything a request needs, safe to cache briefly."""

    key_id: str
    key_name: str
    tenant_id: str | None
    tenant_name: str | None
    scopes: frozenset[str]
    weight: float
    service_tiers: tuple[str, ...]
    default_tier: str
    models: tuple[str, ...] | None
    tenant_quota: Quota
    key_quota: Quota
    expires_at: datetime | None

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes


_DUMMY_HASH = "0" * 64


async def authenticate(session: AsyncSession, plaintext: str, pepper: bytes) -> Principal:
    """The principal of a presented key, or AuthError with the reason it is refused."""
    if plaintext is None or (isinstance(plaintext, str) and not plaintext.strip()):
        raise AuthError("missing")
    if not isinstance(plaintext, str) or not _KEY_RE.match(plaintext):
        raise AuthError("invalid")
    pepper = _check_pepper(pepper)
    stmt = (
        select(ApiKey, Tenant)
        .outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.prefix == keys.lookup_prefix(plaintext))
        .execution_options(populate_existing=True)
    )
    row = (await session.execute(stmt)).first()
    if row is None:
        keys.verify(plaintext, _DUMMY_HASH, pepper)     # same work as a real miss
        raise AuthError("invalid")
    key, tenant = row
    if not keys.verify(plaintext, key.secret_hash, pepper):
        raise AuthError("invalid")
    if key.tenant_id is not None and (tenant is None or tenant.deleted_at is not None):
        raise AuthError("tenant_deleted")
    if key.revoked_at is not None:
        raise AuthError("revoked")
    if key.expires_at is not None and key.expires_at <= utcnow():
        raise AuthError("expired")
    if tenant is not None and tenant.status != "active":
        raise AuthError("tenant_suspended")
    if tenant is None:   # an admin key: no tenant, so no plan (tenant routes refuse it anyway)
        return Principal(
            key_id=key.id, key_name=key.name, tenant_id=None, tenant_name=None,
            scopes=frozenset(key.scopes), weight=1.0, service_tiers=(),
            default_tier="default", models=None, tenant_quota=Quota(),
            key_quota=key_quota(key), expires_at=key.expires_at,
        )
    return Principal(
        key_id=key.id, key_name=key.name, tenant_id=tenant.id, tenant_name=tenant.name,
        scopes=frozenset(key.scopes), weight=tenant.weight,
        service_tiers=tuple(tenant.service_tiers), default_tier=tenant.default_tier,
        models=None if tenant.models is None else tuple(tenant.models),
        tenant_quota=tenant_quota(tenant), key_quota=key_quota(key), expires_at=key.expires_at,
    )


async def ensure_admin_key(session: AsyncSession, plaintext: str, pepper: bytes, *,
                           name: str = "bootstrap") -> bool:
    """Register `plaintext` (e.g. LOCKGATE_ADMIN_KEY) as an admin key unless it is stored
    already (a revoked one stays revoked). True when it was added now."""
    if not isinstance(plaintext, str) or not _KEY_RE.match(plaintext) \
            or len(plaintext) - len(keys.KEY_PREFIX) < _MIN_ADMIN_SECRET:
        raise Invalid("admin_key", f"must be 'lg-' followed by at least {_MIN_ADMIN_SECRET} "
                                   "printable non-space characters")
    name = _check_key_name(name)
    pepper = _check_pepper(pepper)
    prefix = keys.lookup_prefix(plaintext)
    digest = keys.hash_secret(plaintext, pepper)

    async def existing() -> bool:
        stored = await session.scalar(select(ApiKey.secret_hash).where(ApiKey.prefix == prefix))
        if stored is None:
            return False
        if keys.verify(plaintext, stored, pepper):
            return True
        raise Conflict("admin_key", "another key already uses this key's lookup prefix "
                                    f"{prefix!r}; choose a different admin key")

    async def work() -> bool:
        if await existing():
            return False
        key = ApiKey(tenant_id=None, name=name, prefix=prefix, secret_hash=digest,
                     scopes=["admin"], created_at=utcnow())
        session.add(key)
        await session.flush()
        _audit(session, "bootstrap", "key.bootstrap", "key", key.id,
               {"name": name, "prefix": prefix, "scopes": ["admin"]})
        return True

    try:
        return await _in_transaction(session, work)
    except IntegrityError:
        # Another process registered it at the same moment.
        try:
            if await existing():
                return False
        finally:
            await session.rollback()
        raise


async def has_admin_key(session: AsyncSession) -> bool:
    """Whether any usable (unrevoked, unexpired) admin key exists."""
    stmt = select(ApiKey.id).where(
        ApiKey.tenant_id.is_(None),
        ApiKey.revoked_at.is_(None),
        or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()),
    ).limit(1)
    return (await session.scalar(stmt)) is not None


# -- usage -------------------------------------------------------------------------------------


def _check_count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Invalid(field, f"must be an integer >= 0, got {value!r}")
    return value


def _check_ms(value: Any, field: str, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise Invalid(field, f"must be a finite number >= 0, got {value!r}")


@dataclass(slots=True)
class UsageRow:
    """One finished request, as written to `usage_records`."""

    request_id: str
    tenant_id: str
    api_key_id: str
    model: str
    service_tier: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str
    queue_ms: float
    ttft_ms: float | None
    total_ms: float
    created_at: datetime | None = None    # None: when recorded

    def __post_init__(self) -> None:
        for f in ("request_id", "tenant_id", "api_key_id", "model", "service_tier"):
            v = getattr(self, f)
            if not isinstance(v, str) or not v:
                raise Invalid(f, f"must be a non-empty string, got {v!r}")
        if len(self.request_id) > 128:
            raise Invalid("request_id", "must be at most 128 characters")
        if len(self.model) > MODEL_NAME_MAX:
            raise Invalid("model", f"must be at most {MODEL_NAME_MAX} characters")
        if self.service_tier not in SERVICE_TIERS:
            raise Invalid("service_tier", f"must be one of {list(SERVICE_TIERS)}, "
                                          f"got {self.service_tier!r}")
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            _check_count(getattr(self, f), f)
        if self.status not in USAGE_STATUSES:
            raise Invalid("status", f"must be one of {list(USAGE_STATUSES)}, got {self.status!r}")
        _check_ms(self.queue_ms, "queue_ms")
        _check_ms(self.ttft_ms, "ttft_ms", nullable=True)
        _check_ms(self.total_ms, "total_ms")
        self.created_at = _as_utc(self.created_at, "created_at")

    def values(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["created_at"] is None:
            out["created_at"] = utcnow()
        return out


_STOP = object()


class UsageWriter:
    """Group commit of usage rows: one background task inserts whatever `record` calls have
    queued (up to `max_batch` rows, waiting `max_delay_s` for more; 0, the default, is
    classic group commit: rows that arrive during a commit make up the next batch) in one
    executemany and one transaction, on a connection of its own; each `record` returns once
    its row is committed, or raises. `synchronous_commit=False` (PostgreSQL) acknowledges a
    commit before its WAL reaches the disk: visible at once, but a database crash may lose
    the last moments' rows."""

    MAX_BATCH_LIMIT = 2000     # 13 bound values a row; stays under SQLite/PostgreSQL limits

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], max_batch: int = 256,
                 max_delay_s: float = 0.0, synchronous_commit: bool = True) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) \
                or not 1 <= max_batch <= self.MAX_BATCH_LIMIT:
            raise Invalid("max_batch", f"must be an integer from 1 to {self.MAX_BATCH_LIMIT}")
        if isinstance(max_delay_s, bool) or not isinstance(max_delay_s, (int, float)) \
                or not 0 <= max_delay_s <= 10:
            raise Invalid("max_delay_s", "must be a number of seconds from 0 to 10")
        self._sessionmaker = sessionmaker
        self._engine = sessionmaker.kw.get("bind")
        self._conn: Any = None
        self.synchronous_commit = synchronous_commit
        self.max_batch = max_batch
        self.max_delay_s = float(max_delay_s)
        self._queue: asyncio.Queue[Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0          # committed batches
        self.rows = 0             # committed rows
        self.largest_batch = 0

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("UsageWriter already started")
        self._queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="usage-writer")

    async def __aenter__(self) -> UsageWriter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def record(self, row: UsageRow) -> None:
        """Queue `row`; return once it is committed (raise if its commit failed)."""
        await self.submit(row)

    def submit(self, row: UsageRow) -> asyncio.Future[None]:
        """Queue `row` now; the future resolves once it is committed (or fails with the
        commit's error). The writer starts on it at the caller's next `await`, so a caller
        can yield once and then do other work while the row is being written."""
        if not isinstance(row, UsageRow):
            raise Invalid("row", f"must be a UsageRow, got {type(row).__name__}")
        if self._queue is None or self._task is None:
            raise RuntimeError("UsageWriter is not started")
        if self._closed or self._task.done():
            raise RuntimeError("UsageWriter is closed")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((row.values(), fut))
        return fut

    async def close(self) -> None:
        """Write everything queued so far, then stop."""
        if self._task is None or self._task.done():
            self._closed = True
            return
        if not self._closed:
            self._closed = True
            assert self._queue is not None
            self._queue.put_nowait(_STOP)
        await self._task

    def _drain(self, batch: list[tuple[dict[str, Any], asyncio.Future[None]]]) -> bool:
        """Move queued rows into `batch` up to max_batch; True when the stop mark was seen."""
        assert self._queue is not None
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return False
            if item is _STOP:
                return True
            batch.append(item)
        return False

    async def _run(self) -> None:
        assert self._queue is not None
        batch: list[tuple[dict[str, Any], asyncio.Future[None]]] = []
        try:
            stop = False
            while not stop:
                first = await self._queue.get()
                if first is _STOP:
                    break
                batch = [first]
                stop = self._drain(batch)
                if not stop and len(batch) < self.max_batch and self.max_delay_s > 0:
                    await asyncio.sleep(self.max_delay_s)
                    stop = self._drain(batch)
                await self._write(batch)
                batch = []
            # Rows queued after the stop mark (a record racing close) still get written.
            while not self._queue.empty():
                batch = []
                self._drain(batch)
                if batch:
                    await self._write(batch)
            batch = []
            await self._release()
        finally:
            # Cancelled (e.g. at loop shutdown): nobody may wait forever for its row.
            self._closed = True
            gone = RuntimeError("UsageWriter stopped before the row was written")
            for _, fut in batch:
                _settle(fut, gone)
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if item is not _STOP:
                    _settle(item[1], gone)

    async def _insert(self, rows: list[dict[str, Any]]) -> None:
        if self._engine is None:       # a sessionmaker without an engine: plain sessions
            async with self._sessionmaker() as session:
                try:
                    await session.execute(insert(UsageRecord), rows)
                    await session.commit()
                except BaseException:
                    await session.rollback()
                    raise
            return
        for attempt in (0, 1):        # a connection the server dropped is replaced once
            try:
                if self._engine.dialect.name == "postgresql" and self._engine.dialect.driver == "asyncpg":
                    await self._insert_asyncpg(rows)
                    return
                if self._conn is None:
                    self._conn = await self._engine.connect()
                async with self._conn.begin():
                    await self._conn.execute(insert(UsageRecord), rows)
                return
            except IntegrityError:
                raise
            except Exception as exc:
                if _is_integrity_error(exc):
                    raise IntegrityError("INSERT usage_records", None, exc) from exc
                await self._release_quietly()
                if attempt:
                    raise

    async def _insert_asyncpg(self, rows: list[dict[str, Any]]) -> None:
        """PostgreSQL through asyncpg directly: one prepared INSERT, executemany in one
        transaction. A tenth of the CPU of going through SQLAlchemy's async adapter, which
        matters on the path every response waits on."""
        import asyncpg

        if self._conn is None:
            url = self._engine.url.set(drivername="postgresql")
            self._conn = await asyncpg.connect(url.render_as_string(hide_password=False))
            self._columns = [c.name for c in UsageRecord.__table__.columns if c.name != "id"]
            cols = ", ".join(self._columns)
            marks = ", ".join(f"${i + 1}" for i in range(len(self._columns)))
            self._sql = f"INSERT INTO {UsageRecord.__tablename__} ({cols}) VALUES ({marks})"
            if not self.synchronous_commit:   # this connection is the writer's alone
                await self._conn.execute("SET synchronous_commit TO off")
        args = [tuple(r.get(c) for c in self._columns) for r in rows]
        # asyncpg runs executemany atomically (in a transaction of its own when none is open)
        await self._conn.executemany(self._sql, args)

    async def _release_quietly(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            except Exception:  # noqa: BLE001 - it is being replaced
                pass
            self._conn = None

    async def _release(self) -> None:
        if self._conn is not None:
            try:
                await self._conn.close()
            finally:
                self._conn = None

    async def _write(self, batch: list[tuple[dict[str, Any], asyncio.Future[None]]]) -> None:
        try:
            await self._insert([values for values, _ in batch])
        except IntegrityError as exc:
            if len(batch) == 1:
                _settle(batch[0][1], exc)
                return
            # One bad row (e.g. a repeated request_id) must not sink the others.
            for values, fut in batch:
                try:
                    await self._insert([values])
                except Exception as one_exc:  # noqa: BLE001 - handed to the caller
                    _settle(fut, one_exc)
                else:
                    self._count(1)
                    _settle(fut, None)
            return
        except Exception as exc:  # noqa: BLE001 - handed to every caller of the batch
            for _, fut in batch:
                _settle(fut, exc)
            return
        self._count(len(batch))
        for _, fut in batch:
            _settle(fut, None)

    def _count(self, n: int) -> None:
        self.batches += 1
        self.rows += n
        self.largest_batch = max(self.largest_batch, n)


def _is_integrity_error(exc: BaseException) -> bool:
    """asyncpg's unique/foreign-key/check violations (SQLSTATE class 23)."""
    return str(getattr(exc, "sqlstate", "") or "").startswith("23")


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():      # the caller was cancelled; the row's fate no longer matters to it
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _nearest_rank(sorted_values: list[float], p: float) -> float | None:
    """The nearest-rank percentile (p in (0, 100]) of an ascending list, None if empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _group_expr(session: AsyncSession, group_by: str | None) -> Any:
    if group_by == "model":
        return UsageRecord.model
    if group_by == "service_tier":
        return UsageRecord.service_tier
    if group_by == "day":
        if session.bind.dialect.name == "sqlite":
            # Stored as "YYYY-MM-DD HH:MM:SS.ffffff" in UTC.
            return func.substr(UsageRecord.created_at, 1, 10)
        # A literal zone, so that SELECT and GROUP BY render the very same expression.
        return cast(func.timezone(literal_column("'UTC'"), UsageRecord.created_at), Date)
    return None


async def usage_report(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: str | None = None,
) -> list[dict[str, Any]]:
    """Usage totals over [start, end) (UTC), for one tenant or all, overall (one entry, group
    None) or per day (ISO date) / model / service_tier, in group order."""
    if group_by not in GROUP_BY:
        raise Invalid("group_by", f"must be one of {list(GROUP_BY)}, got {group_by!r}")
    if tenant_id is not None and not isinstance(tenant_id, str):
        raise Invalid("tenant_id", "must be a tenant id or null")
    start_utc = _as_utc(start, "start")
    end_utc = _as_utc(end, "end")
    if start_utc is not None and end_utc is not None and end_utc < start_utc:
        raise Invalid("end", "must not be before start")

    conds = []
    if tenant_id is not None:
        conds.append(UsageRecord.tenant_id == tenant_id)
    if start_utc is not None:
        conds.append(UsageRecord.created_at >= start_utc)
    if end_utc is not None:
        conds.append(UsageRecord.created_at < end_utc)
    where = and_(*conds) if conds else None

    key = _group_expr(session, group_by)
    key_col = key.label("g") if key is not None else None

    def status_count(status: str) -> Any:
        return func.coalesce(func.sum(case((UsageRecord.status == status, 1), else_=0)), 0)

    aggs = [
        func.count().label("requests"),
        status_count("ok").label("ok"),
        status_count("error").label("errors"),
        status_count("cancelled").label("cancelled"),
        func.coalesce(func.sum(UsageRecord.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(UsageRecord.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(UsageRecord.completion_tokens), 0).label("completion_tokens"),
    ]
    stmt = select(*([key_col] if key_col is not None else []), *aggs)
    ttft_stmt = select(*([key_col] if key_col is not None else []), UsageRecord.ttft_ms) \
        .where(UsageRecord.ttft_ms.is_not(None))
    if where is not None:
        stmt = stmt.where(where)
        ttft_stmt = ttft_stmt.where(where)
    if key_col is not None:
        stmt = stmt.group_by(key_col).order_by(key_col)

    def norm(g: Any) -> Any:
        return g.isoformat() if isinstance(g, date) else g

    ttfts: dict[Any, list[float]] = {}
    for r in (await session.execute(ttft_stmt)).all():
        g = norm(r.g) if key_col is not None else None
        ttfts.setdefault(g, []).append(float(r.ttft_ms))

    report = []
    for r in (await session.execute(stmt)).all():
        g = norm(r.g) if key_col is not None else None
        values = sorted(ttfts.get(g, []))
        prompt, cached, completion = int(r.prompt_tokens), int(r.cached_tokens), \
            int(r.completion_tokens)
        report.append({
            "group": g,
            "requests": int(r.requests),
            "ok": int(r.ok),
            "errors": int(r.errors),
            "cancelled": int(r.cancelled),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "ttft_ms_p50": _nearest_rank(values, 50),
            "ttft_ms_p95": _nearest_rank(values, 95),
        })
    return report


# -- adapters ----------------------------------------------------------------------------------
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(//|$)|^file:")


def adapter_path(root: Path, path: Any) -> tuple[str, Path]:
    """Check an adapter's `path` against the adapter `root`: (the path relative to the root,
    as stored; the resolved directory). A URL, a `..` part, an absolute path elsewhere or a
    symbolic link leading out of the root is refused (Invalid "path"); so is a missing
    directory. Symbolic links inside the root are resolved, so the stored path cannot be
    redirected later."""
    if not isinstance(path, str) or not path.strip():
        raise Invalid("path", "must be a non-empty path relative to the adapter root")
    if "\x00" in path or len(path) > 1024:
        raise Invalid("path", "must be at most 1024 characters, without NUL")
    if _URL_RE.match(path):
        raise Invalid("path", f"{path!r} is a URL; give a directory inside the adapter root")
    given = Path(path)
    if ".." in given.parts:
        raise Invalid("path", f"{path!r} must not contain '..'; give a directory inside the "
                              "adapter root")
    root_real = root.resolve()
    real = (given if given.is_absolute() else root / given).resolve()
    if real == root_real or not real.is_relative_to(root_real):
        how = " (a symbolic link leads out of it)" if not given.is_absolute() else ""
        raise Invalid("path", f"{path!r} is outside the adapter root{how}")
    if not real.is_dir():
        raise Invalid("path", f"{path!r} is not a directory in the adapter root")
    return real.relative_to(root_real).as_posix(), real


def _check_base_model(base_model: Any) -> str:
    if not isinstance(base_model, str) or not 1 <= len(base_model) <= MODEL_NAME_MAX:
        raise Invalid("base_model", f"must be a model name of 1 to {MODEL_NAME_MAX} characters")
    return base_model


async def check_new_adapter(session: AsyncSession, *, name: str,
                            owner_tenant_id: str | None) -> None:
    """Invalid unless `name` is free and the owner (None: public) is a live tenant."""
    _check_name(name)
    taken = await session.scalar(select(Adapter.id).where(Adapter.name == name))
    if taken is not None:
        raise Invalid("name", f"an adapter named {name!r} already exists")
    if owner_tenant_id is not None:
        tenant = await session.get(Tenant, owner_tenant_id, populate_existing=True)
        if tenant is None or tenant.deleted_at is not None:
            raise Invalid("owner_tenant_id", f"tenant {owner_tenant_id!r} does not exist "
                                             "(or is deleted)")


async def create_adapter(
    session: AsyncSession,
    *,
    name: str,
    base_model: str,
    owner_tenant_id: str | None,
    path: str,
    rank: int,
    targets: Sequence[str],
    actor: str,
    adapter_id: str | None = None,
) -> Adapter:
    """Register an adapter (its files checked by the caller, `path` relative to the root;
    `adapter_id` chosen by the caller or generated). Invalid if the name is taken or the
    owner is not a live tenant."""
    _check_actor(actor)
    _check_base_model(base_model)
    target_list = _check_str_list(targets, "targets")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise Invalid("rank", f"must be an integer >= 1, got {rank!r}")

    async def work() -> Adapter:
        await check_new_adapter(session, name=name, owner_tenant_id=owner_tenant_id)
        adapter = Adapter(id=adapter_id or new_adapter_id(), name=name, base_model=base_model,
                          owner_tenant_id=owner_tenant_id, path=path, rank=rank, targets=target_list, created_at=utcnow())
        session.add(adapter)
        await session.flush()
        _audit(session, actor, "adapter.create", "adapter", adapter.id, {
            "name": name, "base_model": base_model, "owner_tenant_id": owner_tenant_id,
            "path": path, "rank": rank, "targets": target_list,
        })
        return adapter

    try:
        return await _in_transaction(session, work)
    except IntegrityError as exc:
        if _is_unique_violation(exc, "name"):
            raise Invalid("name", f"an adapter named {name!r} already exists") from None
        raise


async def list_adapters(session: AsyncSession) -> list[Adapter]:
    """Every adapter, by name (the admin's view)."""
    return list((await session.scalars(select(Adapter).order_by(Adapter.name))).all())


async def list_tenant_adapters(session: AsyncSession, tenant_id: str) -> list[Adapter]:
    """The adapters a tenant may see: its own and the public ones, by name."""
    stmt = (select(Adapter)
            .where(or_(Adapter.owner_tenant_id.is_(None), Adapter.owner_tenant_id == tenant_id))
            .order_by(Adapter.name))
    return list((await session.scalars(stmt)).all())


async def get_adapter(session: AsyncSession, adapter_id: str) -> Adapter:
    adapter = await session.get(Adapter, adapter_id, populate_existing=True)
    if adapter is None:
        raise NotFound("adapter", adapter_id)
    return adapter


async def find_adapter(session: AsyncSession, name: str) -> Adapter | None:
    """The adapter named `name`, or None."""
    stmt = select(Adapter).where(Adapter.name == name).execution_options(populate_existing=True)
    return await session.scalar(stmt)


async def adapter_ids_by_name(session: AsyncSession, names: Iterable[str]) -> dict[str, str]:
    """name -> id of those of `names` that are registered."""
    names = list(names)
    if not names:
        return {}
    rows = await session.execute(select(Adapter.name, Adapter.id).where(Adapter.name.in_(names)))
    return {name: aid for name, aid in rows}


def _adapter_detail(a: Adapter) -> dict[str, Any]:
    """What the audit log keeps of a deleted adapter."""
    return {"name": a.name, "base_model": a.base_model, "owner_tenant_id": a.owner_tenant_id,
            "path": a.path}


async def delete_adapter(session: AsyncSession, adapter_id: str, *, actor: str) -> Adapter:
    """Delete an adapter's row (usage rows keep its name as their model)."""
    _check_actor(actor)

    async def work() -> Adapter:
        adapter = await get_adapter(session, adapter_id)
        _audit(session, actor, "adapter.delete", "adapter", adapter.id, _adapter_detail(adapter))
        await session.delete(adapter)
        await session.flush()
        return adapter

    return await _in_transaction(session, work)


# -- audit -------------------------------------------------------------------------------------


async def list_audit(session: AsyncSession, limit: int = 100) -> list[AuditEntry]:
    """The newest audit entries first."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise Invalid("limit", f"must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r}")
    stmt = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    return list((await session.scalars(stmt)).all())
