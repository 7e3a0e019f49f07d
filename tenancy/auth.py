"""Authentication: a presented API key -> its `Principal` (key, tenant, plan, quotas), or
`AuthError` with the reason it is refused."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy import keys
from lockgate.tenancy.api_keys import key_quota
from lockgate.tenancy.errors import AuthError, UnknownKeyPrefix
from lockgate.tenancy.models import ApiKey, Tenant, utcnow
from lockgate.tenancy.quota import Quota
from lockgate.tenancy.tenants import tenant_quota
from lockgate.tenancy.validation import check_pepper

_DUMMY_HASH = "0" * 64


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
    # the fraction of a prompt token the budgets count for a cached one (`quota.budget_tokens`)
    cached_input_price: float = 1.0
    # the tenant's own model aliases (name or pattern, served model), before the server's
    model_aliases: tuple[tuple[str, str], ...] = ()
    # the plan's speculative decoding (false: every request decodes without draft tokens)
    speculative: bool = True

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes


async def authenticate(session: AsyncSession, plaintext: str, pepper: bytes) -> Principal:
    """The principal of a presented key, or AuthError with the reason it is refused."""
    if plaintext is None or (isinstance(plaintext, str) and not plaintext.strip()):
        raise AuthError("missing")
    if not keys.well_formed(plaintext):
        raise AuthError("invalid")
    pepper = check_pepper(pepper)
    stmt = (
        select(ApiKey, Tenant)
        .outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.prefix == keys.lookup_prefix(plaintext))
        .execution_options(populate_existing=True)
    )
    row = (await session.execute(stmt)).first()
    if row is None:
        keys.verify(plaintext, _DUMMY_HASH, pepper)     # same work as a real miss
        raise UnknownKeyPrefix()
    key, tenant = row
    if not keys.verify(plaintext, key.secret_hash, pepper):
        raise AuthError("invalid")
    _check_usable(key, tenant)
    return _principal(key, tenant)


async def principal_of_key(session: AsyncSession, key_id: str) -> Principal:
    """The principal of the key with id `key_id` as it stands now (its tenant's plan and
    quotas read afresh), for work a key started and the gateway carries on (a batch's
    lines); AuthError if the key or its tenant may no longer be used."""
    stmt = (
        select(ApiKey, Tenant)
        .outerjoin(Tenant, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.id == key_id)
        .execution_options(populate_existing=True)
    )
    row = (await session.execute(stmt)).first()
    if row is None:
        raise AuthError("invalid")
    key, tenant = row
    _check_usable(key, tenant)
    return _principal(key, tenant)


def _check_usable(key: ApiKey, tenant: Tenant | None) -> None:
    """AuthError unless the key and its tenant may be used now (in this order of reasons)."""
    if key.tenant_id is not None and (tenant is None or tenant.deleted_at is not None):
        raise AuthError("tenant_deleted")
    if key.revoked_at is not None:
        raise AuthError("revoked")
    if key.expires_at is not None and key.expires_at <= utcnow():
        raise AuthError("expired")
    if tenant is not None and tenant.status != "active":
        raise AuthError("tenant_suspended")


def _principal(key: ApiKey, tenant: Tenant | None) -> Principal:
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
        cached_input_price=tenant.cached_input_price,
        model_aliases=tuple((tenant.model_aliases or {}).items()),
        speculative=tenant.speculative,
    )
