"""Usage reports: totals of the usage rows over a time range, for one tenant or all, overall
or grouped by UTC day, model or service tier, with TTFT percentiles."""

from __future__ import annotations

import math
from datetime import date, datetime
from typing import Any

from sqlalchemy import Date, and_, case, cast, func, literal_column, select
from sqlalchemy.ext.asyncio import AsyncSession

from tenancy.errors import Invalid
from tenancy.models import UsageRecord
from tenancy.validation import as_utc

GROUP_BY = (None, "day", "model", "service_tier")


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


def _where(tenant_id: str | None, start: datetime | None, end: datetime | None) -> Any:
    """The rows' filter, after checking the arguments; None for every row."""
    if tenant_id is not None and not isinstance(tenant_id, str):
        raise Invalid("tenant_id", "must be a tenant id or null")
    start_utc = as_utc(start, "start")
    end_utc = as_utc(end, "end")
    if start_utc is not None and end_utc is not None and end_utc < start_utc:
        raise Invalid("end", "must not be before start")
    conds = []
    if tenant_id is not None:
        conds.append(UsageRecord.tenant_id == tenant_id)
    if start_utc is not None:
        conds.append(UsageRecord.created_at >= start_utc)
    if end_utc is not None:
        conds.append(UsageRecord.created_at < end_utc)
    return and_(*conds) if conds else None


def _totals() -> list[Any]:
    """The aggregate columns of one group: request counts by status and token sums."""
    def status_count(status: str) -> Any:
        return func.coalesce(func.sum(case((UsageRecord.status == status, 1), else_=0)), 0)

    return [
        func.count().label("requests"),
        status_count("ok").label("ok"),
        status_count("error").label("errors"),
        status_count("cancelled").label("cancelled"),
        func.coalesce(func.sum(UsageRecord.prompt_tokens), 0).label("prompt_tokens"),
        func.coalesce(func.sum(UsageRecord.cached_tokens), 0).label("cached_tokens"),
        func.coalesce(func.sum(UsageRecord.completion_tokens), 0).label("completion_tokens"),
    ]


def _norm(g: Any) -> Any:
    return g.isoformat() if isinstance(g, date) else g


def _entry(g: Any, r: Any, ttfts: list[float]) -> dict[str, Any]:
    """One report entry from a group's totals row and its TTFTs (ascending)."""
    prompt, cached, completion = int(r.prompt_tokens), int(r.cached_tokens), \
        int(r.completion_tokens)
    return {
        "group": g,
        "requests": int(r.requests),
        "ok": int(r.ok),
        "errors": int(r.errors),
        "cancelled": int(r.cancelled),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "ttft_ms_p50": _nearest_rank(ttfts, 50),
        "ttft_ms_p95": _nearest_rank(ttfts, 95),
    }


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
    where = _where(tenant_id, start, end)
    key = _group_expr(session, group_by)
    key_col = key.label("g") if key is not None else None
    keys = [key_col] if key_col is not None else []

    stmt = select(*keys, *_totals())
    ttft_stmt = select(*keys, UsageRecord.ttft_ms).where(UsageRecord.ttft_ms.is_not(None))
    if where is not None:
        stmt = stmt.where(where)
        ttft_stmt = ttft_stmt.where(where)
    if key_col is not None:
        stmt = stmt.group_by(key_col).order_by(key_col)

    ttfts: dict[Any, list[float]] = {}
    for r in (await session.execute(ttft_stmt)).all():
        g = _norm(r.g) if key_col is not None else None
        ttfts.setdefault(g, []).append(float(r.ttft_ms))

    report = []
    for r in (await session.execute(stmt)).all():
        g = _norm(r.g) if key_col is not None else None
        report.append(_entry(g, r, sorted(ttfts.get(g, []))))
    return report
