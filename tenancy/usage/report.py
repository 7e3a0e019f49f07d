"""Usage reports: totals of the usage rows over a time range, for one tenant or all, overall
or grouped by any of tenant, key, model, service tier and UTC day (together: one group per
combination), with TTFT percentiles; a page at a time (`limit`, and `after` the last group
of the page before: keyset pagination in the groups' order)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from sqlalchemy import Date, and_, case, cast, func, literal_column, not_, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.models import UsageRecord
from lockgate.tenancy.validation import as_utc, check_list_limit

GROUPS = ("tenant", "key", "model", "service_tier", "day")
"""What a report may group by, in any combination and order."""


def parse_group_by(group_by: str | Sequence[str] | None) -> tuple[str, ...]:
    """The groups a `group_by` names: None or "" (one overall entry), a name of `GROUPS`, a
    comma list of them ("tenant,model") or a sequence; Invalid naming `group_by` for an
    unknown or repeated name."""
    if group_by is None or group_by == "":
        return ()
    if isinstance(group_by, str):
        names = [n.strip() for n in group_by.split(",")]
    elif isinstance(group_by, Sequence) and all(isinstance(n, str) for n in group_by):
        names = list(group_by)
    else:
        raise Invalid("group_by", f"must be a comma list of {', '.join(GROUPS)}, got {group_by!r}")
    for i, name in enumerate(names):
        if name not in GROUPS:
            raise Invalid("group_by", f"must be a comma list of {', '.join(GROUPS)}; "
                                      f"{name!r} is not one")
        if name in names[:i]:
            raise Invalid("group_by", f"{name!r} is named twice")
    return tuple(names)


def _nearest_rank(sorted_values: list[float], p: float) -> float | None:
    """The nearest-rank percentile (p in (0, 100]) of an ascending list, None if empty."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _group_expr(session: AsyncSession, group: str) -> Any:
    if group == "tenant":
        return UsageRecord.tenant_id
    if group == "key":
        return UsageRecord.api_key_id
    if group == "model":
        return UsageRecord.model
    if group == "service_tier":
        return UsageRecord.service_tier
    if session.bind.dialect.name == "sqlite":       # day
        # Stored as "YYYY-MM-DD HH:MM:SS.ffffff" in UTC.
        return func.substr(UsageRecord.created_at, 1, 10)
    # A literal zone, so that SELECT and GROUP BY render the very same expression.
    return cast(func.timezone(literal_column("'UTC'"), UsageRecord.created_at), Date)


def _after(exprs: list[Any], values: list[Any]) -> Any:
    """The groups after `values` in the order of `exprs` (lexicographic: the first differing
    column decides)."""
    return or_(*(and_(*(exprs[j] == values[j] for j in range(i)), exprs[i] > values[i])
                 for i in range(len(exprs))))


def _cursor(session: AsyncSession, groups: tuple[str, ...], after: Sequence[Any]) -> list[Any]:
    """`after` (the last group of a page, as the report gives its values) as bind values."""
    if isinstance(after, str) or not isinstance(after, Sequence) or len(after) != len(groups) \
            or not all(isinstance(v, str) for v in after):
        raise Invalid("after", f"must be the {len(groups)} values of a group of this report")
    values: list[Any] = list(after)
    if "day" in groups:
        i = groups.index("day")
        try:
            day = date.fromisoformat(values[i])
        except ValueError:
            raise Invalid("after", f"not a day: {values[i]!r}") from None
        if session.bind.dialect.name != "sqlite":    # a date there, text on SQLite
            values[i] = day
    return values


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
        # rows before cached tokens were priced charged the budgets prompt + completion
        func.coalesce(func.sum(func.coalesce(UsageRecord.budget_tokens, UsageRecord.prompt_tokens
                                             + UsageRecord.completion_tokens)), 0).label("budget_tokens"),
    ]


def _float(v: Any) -> float | None:
    return None if v is None else float(v)


def _norm(g: Any) -> Any:
    return g.isoformat() if isinstance(g, date) else g


def _group_value(groups: tuple[str, ...], key: tuple[Any, ...]) -> Any:
    """An entry's `group`: None overall, the value itself for one group, else {name: value}."""
    if not groups:
        return None
    if len(groups) == 1:
        return key[0]
    return dict(zip(groups, key, strict=True))


def _entry(g: Any, r: Any, ttfts: tuple[float | None, float | None]) -> dict[str, Any]:
    """One report entry from a group's totals row and its TTFT p50 and p95."""
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
        "budget_tokens": int(r.budget_tokens),     # what the day and month budgets counted
        "ttft_ms_p50": ttfts[0],
        "ttft_ms_p95": ttfts[1],
    }


@dataclass(slots=True)
class UsagePage:
    """A page of a report: its entries, whether more follow, and the last one's group values
    (the `after` of the next page; None when the page is empty or ungrouped)."""

    data: list[dict[str, Any]]
    has_more: bool
    last: list[str] | None


async def usage_page(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: str | Sequence[str] | None = None,
    limit: int | None = None,
    after: Sequence[str] | None = None,
) -> UsagePage:
    """Usage totals over [start, end) (UTC), for one tenant or all: one entry overall (group
    None), or one per group of `group_by` (`parse_group_by`) in group order, at most `limit`
    of them (None: all) after the group `after` (`UsagePage.last` of the page before)."""
    groups = parse_group_by(group_by)
    if limit is not None:
        check_list_limit(limit)
    where = _where(tenant_id, start, end)
    exprs = [_group_expr(session, g) for g in groups]
    conds = [] if where is None else [where]
    if after is not None and groups:
        conds.append(_after(exprs, _cursor(session, groups, after)))
    keys = [e.label(f"g{i}") for i, e in enumerate(exprs)]
    # PostgreSQL takes the percentiles in the same statement (percentile_disc is the nearest
    # rank); elsewhere the TTFTs are read and ranked here
    in_sql = session.bind.dialect.name == "postgresql"
    ranks = [func.percentile_disc(p / 100).within_group(UsageRecord.ttft_ms.asc()).label(f"ttft_p{p}")
             for p in (50, 95)] if in_sql else []

    stmt = select(*keys, *_totals(), *ranks)
    if conds:
        stmt = stmt.where(*conds)
    if keys:
        stmt = stmt.group_by(*keys).order_by(*keys)
        if limit is not None:
            stmt = stmt.limit(limit + 1)
    rows = (await session.execute(stmt)).all()
    has_more = limit is not None and bool(keys) and len(rows) > limit
    rows = rows[:limit] if has_more else rows

    ttfts: dict[tuple[Any, ...], list[float]] = {}
    if not in_sql:
        ttft_stmt = select(*keys, UsageRecord.ttft_ms).where(UsageRecord.ttft_ms.is_not(None), *conds)
        if has_more:     # only this page's groups: up to its last one
            ttft_stmt = ttft_stmt.where(not_(_after(exprs, [getattr(rows[-1], k.name) for k in keys])))
        for r in (await session.execute(ttft_stmt)).all():
            ttfts.setdefault(tuple(_norm(v) for v in r[:len(keys)]), []).append(float(r.ttft_ms))

    data = []
    for r in rows:
        key = tuple(_norm(v) for v in r[:len(keys)])
        pcts: tuple[float | None, float | None]
        if in_sql:
            pcts = (_float(r.ttft_p50), _float(r.ttft_p95))
        else:
            ranked = sorted(ttfts.get(key, []))
            pcts = (_nearest_rank(ranked, 50), _nearest_rank(ranked, 95))
        data.append(_entry(_group_value(groups, key), r, pcts))
    last = [str(_norm(v)) for v in rows[-1][:len(keys)]] if keys and rows else None
    return UsagePage(data, has_more, last)


async def usage_report(
    session: AsyncSession,
    *,
    tenant_id: str | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: str | Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """Every entry of the report `usage_page` describes (no paging)."""
    page = await usage_page(session, tenant_id=tenant_id, start=start, end=end, group_by=group_by)
    return page.data
