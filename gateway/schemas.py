"""The admin console's JSON: request bodies (`*Create`, `*Patch`, unknown fields refused)
and what routes answer (`*Public`), built from tenancy's rows by `from_row`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Generic, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from lockgate.gateway.fields import Count, Ident
from lockgate.tenancy import api_keys, tenants
from lockgate.tenancy.quota import Quota

Tier = Literal["default", "priority", "flex"]
T = TypeVar("T")


def iso(dt: datetime | None) -> str | None:
    """A stored time as ISO 8601 with its offset (naive times are UTC)."""
    if dt is None:
        return None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).isoformat()


# -- request bodies ----------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class QuotaBody(_Strict):
    requests_per_minute: Count | None = None
    tokens_per_minute: Count | None = None
    max_concurrent_requests: Count | None = None
    daily_token_budget: Count | None = None
    monthly_token_budget: Count | None = None

    def quota(self) -> Quota:
        return Quota(**self.model_dump())


class TenantCreate(_Strict):
    name: Ident = Field(min_length=1, max_length=64)
    weight: float = Field(default=1.0, gt=0, le=1000)
    service_tiers: list[Tier] | None = None
    default_tier: Tier | None = None
    models: list[Ident] | None = None
    status: Literal["active", "suspended"] = "active"
    quota: QuotaBody | None = None
    # the fraction of a prompt token the budgets count for a cached one (1: as any other)
    cached_input_price: float = Field(default=1.0, ge=0, le=1)
    model_aliases: dict[Ident, Ident] | None = None   # name or pattern (`claude-*`) -> served model
    # false: this tenant's requests decode without draft tokens (where the engine speculates)
    speculative: StrictBool = True


class TenantPatch(_Strict):
    name: Ident | None = Field(default=None, min_length=1, max_length=64)
    weight: float | None = Field(default=None, gt=0, le=1000)
    service_tiers: list[Tier] | None = None
    default_tier: Tier | None = None
    models: list[Ident] | None = None
    status: Literal["active", "suspended"] | None = None
    cached_input_price: float | None = Field(default=None, ge=0, le=1)
    model_aliases: dict[Ident, Ident] | None = None
    speculative: StrictBool | None = None


class KeyCreate(_Strict):
    name: Ident = Field(min_length=1, max_length=128)
    expires_at: datetime | None = None
    scopes: list[Literal["inference", "admin"]] | None = None
    quota: QuotaBody | None = None


class AdminKeyCreate(_Strict):
    name: Ident = Field(min_length=1, max_length=128)
    expires_at: datetime | None = None
    # ["admin"] (the default) or ["viewer"]: a key that reads the admin routes and changes nothing
    scopes: list[Literal["admin", "viewer"]] | None = None


class AdapterCreate(_Strict):
    name: Ident = Field(min_length=1, max_length=64)
    base_model: Ident = Field(min_length=1, max_length=128)
    owner_tenant_id: Ident | None = None   # the tenant that alone may use it; absent or null: public
    path: Ident = Field(min_length=1, max_length=1024)    # a directory under the adapter root


# -- answers -----------------------------------------------------------------------------------------
class QuotaPublic(BaseModel):
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    daily_token_budget: int | None
    monthly_token_budget: int | None

    @classmethod
    def of(cls, quota: Quota) -> QuotaPublic:
        return cls(**quota.to_dict())


class TenantPublic(BaseModel):
    id: str
    object: Literal["tenant"] = "tenant"
    name: str
    status: str
    weight: float
    service_tiers: list[str]
    default_tier: str
    models: list[str] | None
    quota: QuotaPublic
    cached_input_price: float
    model_aliases: dict[str, str] | None
    speculative: bool
    created_at: str | None
    updated_at: str | None

    @classmethod
    def from_row(cls, t: Any) -> TenantPublic:
        return cls(id=t.id, name=t.name, status=t.status, weight=t.weight,
                   service_tiers=list(t.service_tiers), default_tier=t.default_tier,
                   models=list(t.models) if t.models is not None else None,
                   quota=QuotaPublic.of(tenants.tenant_quota(t)),
                   cached_input_price=t.cached_input_price, model_aliases=t.model_aliases,
                   speculative=t.speculative,
                   created_at=iso(t.created_at), updated_at=iso(t.updated_at))


class KeyPublic(BaseModel):
    id: str
    object: Literal["api_key"] = "api_key"
    name: str
    prefix: str
    tenant_id: str | None
    scopes: list[str]
    created_at: str | None
    expires_at: str | None
    revoked_at: str | None
    last_used_at: str | None
    quota: QuotaPublic

    @classmethod
    def from_row(cls, k: Any, **extra: Any) -> Self:
        """The key's row; `extra`: the fields a subclass adds."""
        return cls(id=k.id, name=k.name, prefix=k.prefix, tenant_id=k.tenant_id,
                   scopes=list(k.scopes), created_at=iso(k.created_at),
                   expires_at=iso(k.expires_at), revoked_at=iso(k.revoked_at),
                   last_used_at=iso(k.last_used_at), quota=QuotaPublic.of(api_keys.key_quota(k)),
                   **extra)


class KeyCreatedPublic(KeyPublic):
    key: str                       # the plaintext, shown this once


class AdapterPublic(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    base_model: str
    owner_tenant_id: str | None
    public: bool
    path: str
    rank: int
    targets: list[str]
    created_at: str | None
    registered: bool               # served by this replica's engine now (others read it on first use)

    @classmethod
    def from_row(cls, a: Any, *, registered: bool, **extra: Any) -> Self:
        """The adapter's row; `extra`: the fields a subclass adds."""
        return cls(id=a.id, name=a.name, base_model=a.base_model,
                   owner_tenant_id=a.owner_tenant_id, public=a.owner_tenant_id is None,
                   path=a.path, rank=a.rank, targets=list(a.targets),
                   created_at=iso(a.created_at), registered=registered, **extra)


class AdapterUnloadedPublic(AdapterPublic):
    unloaded: bool                 # its weights were in this replica's memory and are not now


class AuditPublic(BaseModel):
    id: int
    actor: str
    action: str
    target_type: str
    target_id: str | None
    detail: dict[str, Any] | None
    created_at: str | None

    @classmethod
    def from_row(cls, r: Any) -> AuditPublic:
        return cls(id=r.id, actor=r.actor, action=r.action, target_type=r.target_type,
                   target_id=r.target_id, detail=r.detail, created_at=iso(r.created_at))


class ListPublic(BaseModel, Generic[T]):
    object: Literal["list"] = "list"
    data: list[T]


class TenantPagePublic(ListPublic[TenantPublic]):
    has_more: bool
    last_id: str | None


class AuditPagePublic(ListPublic[AuditPublic]):
    has_more: bool
    last_id: str | None            # `after` of the next page


class DeletedPublic(BaseModel):
    id: str
    object: str
    deleted: bool = True


class AdapterDeletedPublic(BaseModel):
    id: str
    object: Literal["adapter"] = "adapter"
    name: str
    deleted: bool = True


class RevokedPublic(BaseModel):
    id: str
    object: Literal["api_key"] = "api_key"
    revoked: bool = True
