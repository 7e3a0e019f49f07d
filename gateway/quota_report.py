"""The quota report over HTTP (`QuotaReportPublic`, JSON), shared by the admin console
(`/admin/v1/quotas/report`: every tenant a page at a time, or `tenant_id=`) and a tenant's own
`/v1/usage/quota`.

For each tenant and each of its live keys, each of the five limits: its value (None: not
set), what the current window, leases or period hold now (`used`, from the limiter, which
keeps the live counters: one `Limiter.live_usage` per limited scope, each bounded by the
Redis timeout; Redis down is a 503 `limiter_unavailable`), what remains, `resets_at` (when
`used` next falls: the oldest window entry leaves the minute window, or the UTC day or month
ends; None for concurrency, whose leases end with their requests), and `refused`, the
requests that very limit refused in [start, end) (default: the last 24 h; `refusal_counts`,
by UTC minute, as flushed so far). A tenant's or key's `refused` map counts all its 429s by
limit, the tenant's limits or the key's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel
from sqlalchemy import select

from lockgate.gateway.errors import APIError, database_unavailable, is_database_down
from lockgate.gateway.serving.ticket import key_scope, tenant_scope
from lockgate.gateway.state import AppState
from lockgate.gateway.usage_api import parse_limit, parse_time
from lockgate.tenancy import tenants
from lockgate.tenancy.errors import Invalid, LimiterUnavailable, NotFound
from lockgate.tenancy.limiter import Limiter, LimitScope
from lockgate.tenancy.limiter.base import ScopeUsage
from lockgate.tenancy.limiter.periods import Periods
from lockgate.tenancy.models import ApiKey, Tenant
from lockgate.tenancy.quota import QUOTA_FIELDS, Quota, quota_of
from lockgate.tenancy.usage.refusals import RefusalTotals, refusal_totals

DEFAULT_RANGE = timedelta(hours=24)
PAGE = 20           # tenants per page by default (each costs a limiter read per limited scope)
MAX_PAGE = 100
ADMIN_QUERY = frozenset({"tenant_id", "start", "end", "limit", "after"})
TENANT_QUERY = frozenset({"tenant_id", "start", "end"})     # tenant_id: the caller's own only


class LimitPublic(BaseModel):
    limit: int | None              # None: not set (unlimited), and so nothing counted
    used: int | None               # requests or tokens in the window, leases held, tokens this period
    remaining: int | None
    resets_at: str | None          # ISO 8601 UTC: when `used` next falls
    refused: int                   # requests this limit refused in [start, end)


class KeyQuotaPublic(BaseModel):
    key_id: str
    name: str
    limits: dict[str, LimitPublic]     # by Quota field, all five
    refused: dict[str, int]            # the key's 429s in [start, end) by limit, anyone's limit


class TenantQuotaPublic(BaseModel):
    tenant_id: str
    name: str
    limits: dict[str, LimitPublic]
    refused: dict[str, int]            # the tenant's 429s in [start, end) by limit
    keys: list[KeyQuotaPublic]
    # the fraction of a prompt token its budgets count for a cached one (tokens per minute: 1)
    cached_input_price: float = 1.0


class QuotaReportPublic(BaseModel):
    object: str = "quota_report"
    generated_at: str
    start: str
    end: str
    data: list[TenantQuotaPublic]
    has_more: bool = False
    last_id: str | None = None         # `after` of the next page (a tenant id)


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def limits_of(quota: Quota, usage: ScopeUsage | None, refused: dict[str, int],
              now: float) -> dict[str, LimitPublic]:
    """Each limit of `quota` beside `usage` (None: the scope is unlimited, nothing read)."""
    periods = Periods.at(now)
    out = {}
    for name in QUOTA_FIELDS:
        limit = getattr(quota, name)
        used: int | None = None
        resets: float | None = None
        if limit is not None and usage is not None:
            used, resets = {
                "requests_per_minute": (usage["requests_in_window"], usage["requests_reset_at"]),
                "tokens_per_minute": (usage["tokens_in_window"], usage["tokens_reset_at"]),
                "max_concurrent_requests": (usage["concurrent"], None),
                "daily_token_budget": (usage["day_tokens"], periods.day_end),
                "monthly_token_budget": (usage["month_tokens"], periods.month_end),
            }[name]
        out[name] = LimitPublic(limit=limit, used=used,
                                remaining=None if used is None or limit is None else max(0, limit - used),
                                resets_at=_iso(resets), refused=refused.get(name, 0))
    return out


def _by_reason(counts: dict[tuple[str, str], int], scope: str | None = None) -> dict[str, int]:
    """Refusals by limit, of one scope ("tenant", "key") or of both (None)."""
    out = dict.fromkeys(QUOTA_FIELDS, 0)
    for (s, reason), n in counts.items():
        if scope is None or s == scope:
            out[reason] = out.get(reason, 0) + n
    return out


async def read_usage(limiter: Limiter, scopes: list[LimitScope]) -> list[ScopeUsage | None]:
    """Each scope's counters (None for an unlimited scope: it keeps none), read at once."""
    async def one(scope: LimitScope) -> ScopeUsage | None:
        return None if scope.quota.unlimited else await limiter.live_usage(scope)

    try:
        return list(await asyncio.gather(*(one(s) for s in scopes)))
    except LimiterUnavailable:
        raise APIError(503, "The rate limiter is unavailable; retry shortly.",
                       code="limiter_unavailable", headers={"retry-after": "1"}) from None


def _live(k: ApiKey, now: datetime) -> bool:
    return k.revoked_at is None and (k.expires_at is None or k.expires_at > now)


async def build_report(state: AppState, rows: list[tuple[Tenant, list[ApiKey]]],
                       totals: RefusalTotals, now: float) -> list[TenantQuotaPublic]:
    """The report entries of `rows` (tenants with their keys)."""
    scopes: list[LimitScope] = []
    for t, keys in rows:
        scopes.append(tenant_scope(t.id, quota_of(t)))
        scopes += [key_scope(t.id, k.id, quota_of(k)) for k in keys]
    usage = iter(await read_usage(state.limiter, scopes))
    data = []
    for t, keys in rows:
        per_key = {kid: c for (tid, kid), c in totals.items() if tid == t.id}
        tenant_counts: dict[tuple[str, str], int] = {}
        for c in per_key.values():
            for sr, n in c.items():
                tenant_counts[sr] = tenant_counts.get(sr, 0) + n
        entry = TenantQuotaPublic(
            tenant_id=t.id, name=t.name, keys=[], refused=_by_reason(tenant_counts),
            cached_input_price=t.cached_input_price,
            limits=limits_of(quota_of(t), next(usage), _by_reason(tenant_counts, "tenant"), now))
        for k in keys:
            counts = per_key.get(k.id, {})
            entry.keys.append(KeyQuotaPublic(
                key_id=k.id, name=k.name, refused=_by_reason(counts),
                limits=limits_of(quota_of(k), next(usage), _by_reason(counts, "key"), now)))
        data.append(entry)
    return data


async def _keys_of(session: Any, tenant_ids: list[str]) -> list[ApiKey]:
    """The keys of all these tenants in one statement, however many the page holds."""
    if not tenant_ids:
        return []
    stmt = select(ApiKey).where(ApiKey.tenant_id.in_(tenant_ids)).order_by(ApiKey.created_at, ApiKey.id)
    return list((await session.scalars(stmt)).all())


def _range(q: Any, now: datetime) -> tuple[datetime, datetime]:
    """The refusals' range: `end` now unless given, `start` a day before `end` unless given."""
    end = parse_time(q.get("end"), "end") or now
    start = parse_time(q.get("start"), "start") or end - DEFAULT_RANGE
    if end < start:
        raise APIError(400, "end: is before start", param="end")
    return start, end


async def quota_response(state: AppState, q: Mapping[str, str], tenant_id: str | None,
                         *, allowed: frozenset[str]) -> QuotaReportPublic:
    """The report of `tenant_id` (None: every live tenant, a page of `limit` after `after`)
    for the query `q`; `allowed`: the query parameters the route takes."""
    unknown = set(q) - allowed
    if unknown:
        name = sorted(unknown)[0]
        raise APIError(400, f"{name}: unknown query parameter", param=name)
    now = time.time()
    start, end = _range(q, datetime.fromtimestamp(now, UTC))
    limit = parse_limit(q.get("limit"), default=PAGE, most=MAX_PAGE)
    try:
        async with state.sessions() as session:
            if tenant_id is not None:
                page, has_more = [await tenants.get_tenant(session, tenant_id)], False
            else:
                page = await tenants.list_tenants(session, limit=limit + 1,
                                                  after=q.get("after") or None)
                has_more, page = len(page) > limit, page[:limit]
            at = datetime.fromtimestamp(now, UTC)
            keys = await _keys_of(session, [t.id for t in page])
            rows = [(t, [k for k in keys if k.tenant_id == t.id and _live(k, at)]) for t in page]
            totals = await refusal_totals(session, tenant_ids=[t.id for t in page],
                                          start=start, end=end)
    except NotFound as exc:
        raise APIError(404, str(exc), param="tenant_id", code="not_found") from None
    except Invalid as exc:
        raise APIError(400, str(exc), param=exc.field) from None
    except Exception as exc:
        if is_database_down(exc):
            raise database_unavailable() from None
        raise
    return QuotaReportPublic(generated_at=_iso(now) or "", start=start.isoformat(),
                             end=end.isoformat(), data=await build_report(state, rows, totals, now),
                             has_more=has_more, last_id=page[-1].id if page else None)
