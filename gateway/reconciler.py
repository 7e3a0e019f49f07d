"""The lease reconciler: the admissions of requests that died with their process.

A replica killed mid-request leaves its admissions unsettled on Redis: their concurrency
leases free themselves `lease_ttl_s` after their last heartbeat, but their token reservations
would stay charged to the budgets and tokens-per-minute windows. Every replica, once per
heartbeat, asks the limiter for admissions whose lease ran out (`Limiter.expired`) and, for
each that is not one of its own live requests, looks for the request's usage row: a row means
the request ended and its settlement was lost, so it is settled to exactly the row's tokens (its budget charge too);
no row means it died before its row was written, so its reservation is refunded
(`Limiter.abandon`: it keeps its request count). Budgets then charge what usage rows show.
Replicas may race on one admission: settle and abandon each consume its marker atomically,
so the first wins and the rest are no-ops. A request found expired but alive after all (its
replica lost Redis for longer than `lease_ttl_s`) is charged in full when it settles.

With the database unreachable nothing is decided (a row may be there): the next beat retries.

"No row" is not "never a row": a replica that answered while the database was down kept its
rows in its spool (`tenancy.usage.spool`), and if it died before replaying them another
replica finds their admissions expired with no row and refunds them; the rows arrive when the
dead replica restarts. Two ways to keep budgets equal to rows: never refund an admission
whose row may still be spooled, or charge a refunded admission when its row arrives. The
first cannot be decided here: no replica can see another's disk, so it would mean never
refunding at all (or only after a guess of how long a spool may wait), and every request that
truly died before its row (a replica killed mid-stream) would keep its whole reservation on
the budget. So refunds stay, and the replay charges them: `abandon` leaves the admission's
marker 'r' with its lease's scopes, day and month for `REFUND_TTL` (days), and the usage
writer, once it has inserted a spooled file's rows, hands them to `replay_charger`, which
charges each whose marker says refunded and consumes the marker in the same script
(`Limiter.charge_replayed`): once, however many replicas replay it or however often. A row
whose admission was not refunded finds no 'r' and is not charged again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.gateway.state import AppState
from lockgate.tenancy.limiter import Lease, Limiter
from lockgate.tenancy.limiter.base import ReplayedRow
from lockgate.tenancy.models import UsageRecord

logger = logging.getLogger(__name__)


async def billed_tokens(sessions: async_sessionmaker[AsyncSession],
                        request_ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """request id -> (prompt + completion tokens, what the budgets were charged) of its usage
    row, for those that have one."""
    total = UsageRecord.prompt_tokens + UsageRecord.completion_tokens
    async with sessions() as session:
        rows = await session.execute(select(UsageRecord.request_id, total, UsageRecord.budget_tokens)
                                     .where(UsageRecord.request_id.in_(list(request_ids))))
        return {rid: (int(tokens), int(tokens if budget is None else budget)) for rid, tokens, budget in rows}


async def reconcile_once(state: AppState) -> dict[str, int]:
    """One pass: counts of admissions ``settled`` (to their row), ``abandoned`` (refunded),
    ``skipped`` (this replica's own live requests, or taken by another replica first)."""
    counts = {"settled": 0, "abandoned": 0, "skipped": 0}
    limiter = state.limiter
    expired = [lease for lease in await limiter.expired() if lease.request_id not in state.inflight]
    if not expired:
        return counts
    try:
        rows = await asyncio.wait_for(
            billed_tokens(state.sessions, [lease.request_id for lease in expired]),
            state.settings.database_timeout_s)
    except Exception as exc:  # noqa: BLE001 - any database failure: decide nothing, retry later
        logger.warning("lease reconciler: usage rows unreadable (%r); retrying next beat", exc)
        return counts
    async def one(lease: Lease) -> str:
        used = rows.get(lease.request_id)
        if used is not None:
            await limiter.settle(lease, *used)
            return "settled"
        return "abandoned" if await limiter.abandon(lease) else "skipped"

    for outcome in await asyncio.gather(*(one(lease) for lease in expired)):
        counts[outcome] += 1
    logger.warning("lease reconciler: %d admission(s) of dead requests settled to their usage "
                   "rows, %d refunded (no row), %d skipped", counts["settled"],
                   counts["abandoned"], counts["skipped"])
    return counts


def replay_charger(limiter: Limiter) -> Callable[[list[dict[str, Any]]], Awaitable[int]]:
    """The usage writer's hook for rows it replayed from its spool: each charged to the
    budgets if its admission was refunded meanwhile (see the module docstring)."""
    async def charge(rows: list[dict[str, Any]]) -> int:
        replayed = [ReplayedRow(request_id=r["request_id"], tenant_id=r["tenant_id"],
                                api_key_id=r["api_key_id"],
                                tokens=_budget_tokens(r),
                                created_at=r["created_at"].timestamp()
                                if isinstance(r.get("created_at"), datetime) else 0.0)
                    for r in rows]
        return await limiter.charge_replayed(replayed)
    return charge


def _budget_tokens(row: dict[str, Any]) -> int:
    """What the row's request counts against the budgets (its plan may price cached prompt
    tokens lower; a row without the figure was charged prompt + completion)."""
    if row.get("budget_tokens") is not None:
        return int(row["budget_tokens"])
    return int(row["prompt_tokens"]) + int(row["completion_tokens"])
