"""The console overview's timeline: per UTC hour and service tier, the requests, tokens, errors
and limit refusals, and the TTFT p50 and p99 of the hour and of the whole range, in ONE SQL
statement whatever the row counts (the usage rows' and the refusal counts' aggregates, joined
by UNION ALL), on PostgreSQL and SQLite alike.

The percentiles are nearest-rank, taken in SQL with window functions (portable, unlike
PostgreSQL's `percentile_disc`): each TTFT is ranked within its hour and tier and within its
tier, and the value whose rank is ceil(p/100 * n) is kept. Only the buckets leave the database:
at most hours x tiers rows of each kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Float, Integer, String, case, cast, func, literal, literal_column, null, select, union_all
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.models import RefusalCount, UsageRecord
from lockgate.tenancy.validation import as_utc

PERCENTILES = (50, 99)


@dataclass(slots=True)
class Bucket:
    """One hour of one tier."""

    requests: int = 0
    tokens: int = 0          # prompt + completion
    errors: int = 0
    refusals: int = 0
    ttft_ms: dict[int, float | None] = field(default_factory=dict)   # percentile -> ms


@dataclass(slots=True)
class Timeline:
    """`hours`: the range's UTC hours, oldest first ("YYYY-MM-DD HH"); `tiers`: the tiers
    seen, sorted; `buckets[(hour, tier)]`; `ttft_ms[tier][p]`: the range's percentiles."""

    hours: list[str]
    tiers: list[str]
    buckets: dict[tuple[str, str], Bucket]
    ttft_ms: dict[str, dict[int, float | None]]

    def series(self, tier: str, what: str) -> list[float]:
        """One value an hour (0 for an hour without rows): `what` is a Bucket field, or
        "ttft_p50" / "ttft_p99" (an hour without TTFTs: 0)."""
        out = []
        for hour in self.hours:
            b = self.buckets.get((hour, tier))
            if b is None:
                out.append(0.0)
            elif what.startswith("ttft_p"):
                out.append(b.ttft_ms.get(int(what[6:])) or 0.0)
            else:
                out.append(float(getattr(b, what)))
        return out

    def total(self, tier: str, what: str) -> int:
        return int(sum(self.series(tier, what)))


def _hour(session: AsyncSession, column: Any) -> Any:
    """A timestamp's UTC hour as text, "YYYY-MM-DD HH", the same on both databases."""
    if session.bind.dialect.name == "sqlite":     # stored as "YYYY-MM-DD HH:MM:SS.ffffff" in UTC
        return func.substr(column, 1, 13)
    return func.to_char(func.timezone(literal_column("'UTC'"), column), literal_column("'YYYY-MM-DD HH24'"))


def _rank_of(n: Any, p: int) -> Any:
    """ceil(p/100 * n) in integer arithmetic (SQLite may lack ceil)."""
    return (n * p + 99) // 100


def hours_of(start: datetime, end: datetime) -> list[str]:
    """The UTC hours that [start, end) touches, oldest first."""
    hour = start.replace(minute=0, second=0, microsecond=0)
    out = []
    while hour < end:
        out.append(hour.strftime("%Y-%m-%d %H"))
        hour += timedelta(hours=1)
    return out


def _statement(session: AsyncSession, start: datetime, end: datetime) -> Any:
    u = UsageRecord
    hour, tier = _hour(session, u.created_at), u.service_tier
    missing = case((u.ttft_ms.is_(None), 1), else_=0)       # TTFTs first, ascending, on both
    ranked = (select(hour.label("hour"), tier.label("tier"), u.ttft_ms.label("ttft"),
                     (u.prompt_tokens + u.completion_tokens).label("tokens"),
                     case((u.status == "error", 1), else_=0).label("error"),
                     func.row_number().over(partition_by=[hour, tier], order_by=[missing, u.ttft_ms]).label("rn_h"),
                     func.count(u.ttft_ms).over(partition_by=[hour, tier]).label("n_h"),
                     func.row_number().over(partition_by=[tier], order_by=[missing, u.ttft_ms]).label("rn_t"),
                     func.count(u.ttft_ms).over(partition_by=[tier]).label("n_t"))
              .where(u.created_at >= start, u.created_at < end)
              .subquery())
    r = ranked.c

    def pick(rn: Any, n: Any, p: int) -> Any:
        return cast(func.max(case(((n > 0) & (rn == _rank_of(n, p)), r.ttft), else_=null())), Float)

    usage = (select(r.hour, r.tier, literal("usage", String).label("kind"),
                    cast(func.count(), Integer).label("requests"), cast(func.sum(r.tokens), Integer).label("tokens"),
                    cast(func.sum(r.error), Integer).label("errors"), cast(literal(0), Integer).label("refusals"),
                    *(pick(r.rn_h, r.n_h, p).label(f"h{p}") for p in PERCENTILES),
                    *(pick(r.rn_t, r.n_t, p).label(f"t{p}") for p in PERCENTILES))
             .group_by(r.hour, r.tier))
    rc = RefusalCount
    rhour = _hour(session, rc.minute)
    nothing = cast(null(), Float)
    refused = (select(rhour.label("hour"), rc.service_tier.label("tier"), literal("refusals", String).label("kind"),
                      cast(literal(0), Integer), cast(literal(0), Integer), cast(literal(0), Integer),
                      cast(func.sum(rc.count), Integer), *(nothing for _ in PERCENTILES * 2))
               .where(rc.minute >= start, rc.minute < end)
               .group_by(rhour, rc.service_tier))
    return union_all(usage, refused)


async def timeline(session: AsyncSession, *, start: datetime, end: datetime) -> Timeline:
    """Per UTC hour of [start, end) and tier, what the usage rows and refusal counts say (one
    statement; see the module docstring)."""
    start_utc, end_utc = as_utc(start, "start"), as_utc(end, "end")
    if start_utc is None or end_utc is None or end_utc <= start_utc:
        raise Invalid("end", "the range needs a start and an end after it")
    buckets: dict[tuple[str, str], Bucket] = {}
    ttft: dict[str, dict[int, float | None]] = {}
    for row in (await session.execute(_statement(session, start_utc, end_utc))).all():
        b = buckets.setdefault((row.hour, row.tier), Bucket())
        if row.kind == "refusals":
            b.refusals += int(row.refusals)
            continue
        b.requests, b.tokens, b.errors = int(row.requests), int(row.tokens or 0), int(row.errors or 0)
        b.ttft_ms = {p: getattr(row, f"h{p}") for p in PERCENTILES}
        seen = ttft.setdefault(row.tier, dict.fromkeys(PERCENTILES))
        for p in PERCENTILES:        # exactly one hour of the tier holds the range's rank-p TTFT
            if (v := getattr(row, f"t{p}")) is not None:
                seen[p] = v
    hours = hours_of(start_utc, end_utc)
    tiers = sorted({t for _, t in buckets})
    return Timeline(hours, tiers, {k: v for k, v in buckets.items() if k[0] in hours}, ttft)
