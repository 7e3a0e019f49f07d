"""API key rows: creation (the plaintext shown once), listing, revocation, a key's own quota,
its last use, and the bootstrap admin key. The key material itself is `tenancy.keys`.

Every change is one audited transaction, as in `tenancy.tenants`; `touch_key` is bookkeeping
on the request path and writes no audit entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, String, cast, delete, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy import audit, keys
from lockgate.tenancy.db import in_transaction
from lockgate.tenancy.errors import Conflict, Invalid, NotFound
from lockgate.tenancy.models import ADMIN_SCOPES, SCOPES, ApiKey, ConsoleSession, utcnow
from lockgate.tenancy.quota import Quota, quota_of, store_quota
from lockgate.tenancy.tenants import get_tenant, tenant_for_update
from lockgate.tenancy.validation import as_utc, check_actor, check_pepper, check_quota, check_str_list, check_text

KEY_NAME_MAX = 64
_MIN_ADMIN_SECRET = 32     # characters after "lg-" in a bootstrap admin key


def _check_key_name(name: Any) -> str:
    if not isinstance(name, str):
        raise Invalid("name", f"must be a string, got {type(name).__name__}")
    if not name.strip() or len(name) > KEY_NAME_MAX:
        raise Invalid("name", f"must be 1 to {KEY_NAME_MAX} characters, not blank")
    if any(not ch.isprintable() for ch in name):
        raise Invalid("name", "must not contain control characters")
    return name


def _check_scopes(scopes: Any) -> list[str]:
    items = check_str_list(scopes, "scopes")
    unknown = [s for s in items if s not in SCOPES]
    if unknown:
        raise Invalid("scopes", f"unknown scope(s) {unknown}; known: {list(SCOPES)}")
    if not items:
        raise Invalid("scopes", "must name at least one scope")
    return [s for s in SCOPES if s in items]


def _check_owner(tenant_id: Any, scope_list: list[str]) -> None:
    """A tenant key has scope "inference" only; a key without tenant (an admin key) exactly
    "admin", or exactly "viewer" (one that reads the admin side and changes nothing)."""
    if tenant_id is not None:
        if not isinstance(tenant_id, str):
            raise Invalid("tenant_id", "must be a tenant id or null")
        if any(s in ADMIN_SCOPES for s in scope_list):
            raise Invalid("scopes", "a tenant key cannot have the 'admin' or 'viewer' scope; "
                                    "admin keys have tenant_id null")
    elif scope_list not in (["admin"], ["viewer"]):
        raise Invalid("tenant_id", "required for an 'inference' key; a key without a tenant "
                                   "is an admin key with scopes ['admin'] or ['viewer']")


def key_quota(k: ApiKey) -> Quota:
    """The quota stored on an API key."""
    return quota_of(k)


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
    check_actor(actor)
    name = _check_key_name(name)
    scope_list = _check_scopes(scopes)
    _check_owner(tenant_id, scope_list)
    expires = as_utc(expires_at, "expires_at")
    if expires is not None and expires <= utcnow():
        raise Invalid("expires_at", f"{expires.isoformat()} is in the past")
    q = check_quota(quota)
    pepper = check_pepper(pepper)

    async def work() -> tuple[ApiKey, str]:
        if tenant_id is not None:
            await tenant_for_update(session, tenant_id)
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
        store_quota(key, q)
        session.add(key)
        await session.flush()
        audit.record(session, actor, "key.create", "key", key.id, {
            "tenant_id": tenant_id, "name": name, "scopes": scope_list, "prefix": prefix,
            "expires_at": expires.isoformat() if expires else None, "quota": q.to_dict(),
        })
        return key, plaintext

    return await in_transaction(session, work)


async def list_keys(session: AsyncSession, tenant_id: str | None) -> list[ApiKey]:
    """A live tenant's keys (revoked ones included), or the admin keys for tenant_id None."""
    cond: ColumnElement[bool]
    if tenant_id is None:
        cond = ApiKey.tenant_id.is_(None)
    else:
        await get_tenant(session, tenant_id)
        cond = ApiKey.tenant_id == tenant_id
    stmt = select(ApiKey).where(cond).order_by(ApiKey.created_at, ApiKey.id)
    return list((await session.scalars(stmt)).all())


async def get_key(session: AsyncSession, key_id: str) -> ApiKey:
    """The key (revoked or not); NotFound if no such id."""
    key = await session.get(ApiKey, check_text(key_id, "key_id"))
    if key is None:
        raise NotFound("key", key_id)
    return key


async def revoke_key(session: AsyncSession, key_id: str, *, actor: str) -> ApiKey:
    """Revoke a key; revoking a revoked key changes nothing."""
    check_actor(actor)

    async def work() -> ApiKey:
        key = await session.get(ApiKey, check_text(key_id, "key_id"), populate_existing=True)
        if key is None:
            raise NotFound("key", key_id)
        if key.revoked_at is None:
            key.revoked_at = utcnow()
            audit.record(session, actor, "key.revoke", "key", key.id,
                         {"tenant_id": key.tenant_id, "name": key.name})
            # its console sessions end with it (each request reads the key anyway)
            await session.execute(delete(ConsoleSession).where(ConsoleSession.api_key_id == key.id))
            await session.flush()
        return key

    return await in_transaction(session, work)


async def set_key_quota(session: AsyncSession, key_id: str, quota: Quota, *,
                        actor: str) -> ApiKey:
    """Replace a key's own quota (on top of its tenant's)."""
    check_actor(actor)
    q = check_quota(quota)

    async def work() -> ApiKey:
        key = await session.get(ApiKey, check_text(key_id, "key_id"), populate_existing=True)
        if key is None:
            raise NotFound("key", key_id)
        before = key_quota(key).to_dict()
        store_quota(key, q)
        audit.record(session, actor, "key.set_quota", "key", key.id,
                     {"before": before, "after": q.to_dict()})
        await session.flush()
        return key

    return await in_transaction(session, work)


async def touch_key(session: AsyncSession, key_id: str, when: datetime) -> None:
    """Record the key's last use (never moves backwards). No audit entry."""
    when_utc = as_utc(when, "when")

    async def work() -> None:
        await session.execute(
            update(ApiKey)
            .where(ApiKey.id == key_id,
                   or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < when_utc))
            .values(last_used_at=when_utc)
            .execution_options(synchronize_session=False)
        )

    await in_transaction(session, work)


# -- the bootstrap admin key -------------------------------------------------------------------


async def ensure_admin_key(session: AsyncSession, plaintext: str, pepper: bytes, *,
                           name: str = "bootstrap") -> bool:
    """Register `plaintext` (e.g. LOCKGATE_ADMIN_KEY) as an admin key unless it is stored
    already (a revoked one stays revoked). True when it was added now."""
    if not keys.well_formed(plaintext) \
            or len(plaintext) - len(keys.KEY_PREFIX) < _MIN_ADMIN_SECRET:
        raise Invalid("admin_key", f"must be 'lg-' followed by at least {_MIN_ADMIN_SECRET} "
                                   "printable non-space characters")
    name = _check_key_name(name)
    pepper = check_pepper(pepper)
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
        audit.record(session, "bootstrap", "key.bootstrap", "key", key.id,
                     {"name": name, "prefix": prefix, "scopes": ["admin"]})
        return True

    try:
        return await in_transaction(session, work)
    except IntegrityError:
        # Another process registered it at the same moment.
        try:
            if await existing():
                return False
        finally:
            await session.rollback()
        raise


async def has_admin_key(session: AsyncSession) -> bool:
    """Whether any usable (unrevoked, unexpired) admin key exists (a viewer key is not one)."""
    stmt = select(ApiKey.id).where(
        ApiKey.tenant_id.is_(None),
        # the JSON list as text, on SQLite and PostgreSQL alike
        cast(ApiKey.scopes, String).like('%"admin"%'),
        ApiKey.revoked_at.is_(None),
        or_(ApiKey.expires_at.is_(None), ApiKey.expires_at > utcnow()),
    ).limit(1)
    return (await session.scalar(stmt)) is not None
