"""Budgets rebuilt from the usage rows (`BudgetRebuilder`): what the Redis limiter's day and
month counters of one tag should hold, read from `usage_records`, for when Redis lost them.

The usage rows are the truth of what was billed; the counters are their running sum. A tag's
counters are lost with its Redis node (a restart without persistence, a Cluster node that
comes back empty), and so is the tag's *epoch* key; the limiter then asks this module for the
tag's totals before it admits anything of the tag again (`tenancy.limiter.redis_epoch`).

Scopes and rows: the gateway counts a tenant's request against the scopes
``tenant:<tenant id>`` (the tag, `tenant_scope_key`) and ``key:<api key id>`` in the tenant's
tag (`key_scope_key`); a row is theirs by its ``tenant_id`` and ``api_key_id``. The totals are
prompt + completion tokens of the rows created in the UTC day and month (`created_at`). A tag
of another shape has no rows: its counters start from nothing.

What the rebuild counted is exactly the rows with ``id <= high_water``: on PostgreSQL the
read holds ``usage_records`` in SHARE mode (it waits for inserts under way to commit, and
holds new ones back for the few milliseconds of the sums), so no row committed later has a
smaller id; on SQLite writers are serialized and a row's id is larger than every committed
one. `counted` answers, for a settlement or a replayed row of an admission from before the
rebuild, whether the rebuild already counted its row. Every read is bounded by ``timeout_s``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import case, func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.tenancy.limiter.periods import Periods
from lockgate.tenancy.models import UsageRecord

TENANT = "tenant:"
KEY = "key:"


def tenant_scope_key(tenant_id: str | None) -> str:
    """The scope key (and tag) of a tenant's limits."""
    return f"{TENANT}{tenant_id}"


def key_scope_key(key_id: str) -> str:
    """The scope key of an API key's limits (in its tenant's tag)."""
    return f"{KEY}{key_id}"


@dataclass(frozen=True)
class Totals:
    """A tag's tokens in one UTC day and month, by scope key, as of the rows ``id <= high_water``."""

    high_water: int
    day: dict[str, int] = field(default_factory=dict)
    month: dict[str, int] = field(default_factory=dict)


def _at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


class BudgetRebuilder:
    """The usage rows' side of a rebuild, on the gateway's database."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], timeout_s: float = 5.0) -> None:
        self.sessions = sessions
        self.timeout_s = float(timeout_s)

    async def totals(self, tag: str, p: Periods) -> Totals:
        """The tag's day and month totals in ``p``'s periods (see the module docstring)."""
        async with asyncio.timeout(self.timeout_s), self.sessions() as s, s.begin():
            if s.get_bind().dialect.name == "postgresql":
                # bounded by our own timeout too: the lock waits for inserts under way
                await s.execute(text(f"SET LOCAL lock_timeout = {int(self.timeout_s * 1000)}"))
                await s.execute(text(f"LOCK TABLE {UsageRecord.__tablename__} IN SHARE MODE"))
            high = int((await s.execute(select(func.coalesce(func.max(UsageRecord.id), 0)))).scalar_one())
            if not tag.startswith(TENANT):
                return Totals(high)
            tenant_id = tag[len(TENANT):]
            # what the budgets were charged: cached prompt tokens may be priced lower
            tokens = func.coalesce(UsageRecord.budget_tokens,
                                   UsageRecord.prompt_tokens + UsageRecord.completion_tokens)
            in_day = (UsageRecord.created_at >= _at(p.day_start)) & (UsageRecord.created_at < _at(p.day_end))
            rows = await s.execute(
                select(UsageRecord.api_key_id, func.sum(case((in_day, tokens), else_=0)), func.sum(tokens))
                .where(UsageRecord.tenant_id == tenant_id, UsageRecord.id <= high,
                       UsageRecord.created_at >= _at(p.month_start),
                       UsageRecord.created_at < _at(p.month_end))
                .group_by(UsageRecord.api_key_id))
            totals = Totals(high, {tag: 0}, {tag: 0})
            for key_id, day, month in rows:
                scope = key_scope_key(key_id)
                totals.day[scope], totals.month[scope] = int(day or 0), int(month or 0)
                totals.day[tag] += int(day or 0)
                totals.month[tag] += int(month or 0)
            return totals

    async def counted(self, request_id: str, high_water: int) -> bool:
        """Whether the request's usage row was counted by a rebuild that counted the rows up
        to ``high_water`` (False when it has no row yet: it will have a larger id)."""
        async with asyncio.timeout(self.timeout_s), self.sessions() as s:
            row_id = (await s.execute(select(UsageRecord.id)
                                      .where(UsageRecord.request_id == request_id))).scalar()
        return row_id is not None and int(row_id) <= high_water
