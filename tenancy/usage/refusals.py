"""Refusal counts: how many requests each limit refused (the 429s), per tenant, key, whose
limit it was (the tenant's or the key's), limit, service tier and UTC minute, for the quota
report and the console's overview (refusals per tier over time).

A flooding tenant must not turn its 429s into database writes, so `RefusalCounter.record`
only adds 1 to a counter in memory. `flush`, every `interval_s` and once more at shutdown,
adds those deltas to `refusal_counts` in one transaction: an upsert that adds to the stored
count (``count = count + excluded.count``, on SQLite and PostgreSQL alike), so the counts of
every replica add up in one durable place. A flush is bounded by `timeout_s`; one that fails
keeps its deltas and adds them again on the next. Memory is bounded by `max_buckets`
counters: refusals past it are dropped, counted (`dropped`) and logged at the next flush.

A flush that times out after the database committed it adds its deltas again on the next:
the counts may then run high, never low. Rows are upserted in key order, so two replicas
flushing the same counters lock them in the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.models import RefusalCount
from lockgate.tenancy.validation import as_utc

logger = logging.getLogger(__name__)

SCOPES = ("tenant", "key")
Bucket = tuple[str, str, str, str, str, int]   # tenant id, key id, scope, reason, tier, minute (epoch s)
CHUNK = 1000                                   # rows per INSERT: 7 values a row, under both limits


def _positive(name: str, v: object, most: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= most:
        raise Invalid(name, f"must be a number over 0, at most {most:g}")
    return float(v)


class RefusalCounter:
    """Refusals counted in memory, flushed to `refusal_counts` in the background (see the
    module docstring). `start()` runs the flushes; `close()` stops them and flushes once more."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], *, interval_s: float = 5.0,
                 timeout_s: float = 5.0, max_buckets: int = 100_000,
                 clock: Callable[[], float] = time.time) -> None:
        self.interval_s = _positive("interval_s", interval_s, 86400)
        self.timeout_s = _positive("timeout_s", timeout_s, 600)
        if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
            raise Invalid("max_buckets", "must be an integer >= 1")
        self.max_buckets = max_buckets
        self._sessionmaker = sessionmaker
        self._clock = clock
        self._pending: dict[Bucket, int] = {}
        self._flushing = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.flushed = 0            # refusals written to the table
        self.failed_flushes = 0
        self.dropped = 0            # refusals lost to the max_buckets bound
        self._dropped_logged = 0
        self._in_flight = 0         # refusals of the flush under way
        self._failing = False       # the last flush failed

    @property
    def pending(self) -> int:
        """Refusals counted here and not yet in the table (a flush's under way included)."""
        return sum(self._pending.values()) + self._in_flight

    def record(self, tenant_id: str, key_id: str, scope: str, reason: str, *, tier: str) -> None:
        """Count one refusal of `reason` (a Quota field) by `scope`'s limit ("tenant" or "key")
        of a request of service tier `tier` in the current UTC minute. No I/O."""
        minute = int(self._clock() // 60) * 60
        self._add((tenant_id, key_id, scope, reason, tier, minute), 1)

    def _add(self, bucket: Bucket, n: int) -> None:
        held = self._pending.get(bucket)
        if held is None and len(self._pending) >= self.max_buckets:
            self.dropped += n
            return
        self._pending[bucket] = (held or 0) + n

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("RefusalCounter already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="refusal-counter")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def close(self) -> None:
        """Stop the flushes, then flush what is left (bounded by `timeout_s`)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if not await self.flush() and self._pending:
            logger.warning("refusal counts: %d refusals not written at shutdown", self.pending)

    async def flush(self) -> bool:
        """Add the refusals counted so far to the table. True when written (or none to
        write); False when the database did not take them: they are kept for the next."""
        async with self._flushing:
            if self.dropped > self._dropped_logged:
                logger.warning("refusal counts: %d refusals dropped (more than %d counters held)",
                               self.dropped - self._dropped_logged, self.max_buckets)
                self._dropped_logged = self.dropped
            if not self._pending:
                return True
            batch, self._pending = self._pending, {}
            self._in_flight = sum(batch.values())
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._upsert(batch)
            except BaseException as exc:
                self._in_flight = 0
                for bucket, n in batch.items():     # kept, with what was counted meanwhile
                    self._add(bucket, n)
                if not isinstance(exc, Exception):
                    raise                            # cancelled: kept for close()'s flush
                self.failed_flushes += 1
                # once per outage as a warning; its retries, every interval, as info
                logger.log(logging.INFO if self._failing else logging.WARNING,
                           "refusal counts: flush failed, %d refusals kept to retry: %r",
                           self.pending, exc)
                self._failing = True
                return False
            self.flushed += self._in_flight
            self._in_flight = 0
            if self._failing:
                logger.info("refusal counts: flushed again after a failure")
                self._failing = False
            return True

    async def _upsert(self, batch: dict[Bucket, int]) -> None:
        rows = [{"tenant_id": t, "api_key_id": k, "scope": s, "reason": r, "service_tier": tier,
                 "minute": datetime.fromtimestamp(m, UTC), "count": n}
                for (t, k, s, r, tier, m), n in sorted(batch.items())]
        async with self._sessionmaker() as session:
            dialect = session.get_bind().dialect.name
            make = postgresql.insert if dialect == "postgresql" else sqlite.insert
            stmt = make(RefusalCount)
            stmt = stmt.on_conflict_do_update(
                index_elements=["tenant_id", "api_key_id", "scope", "reason", "service_tier", "minute"],
                set_={"count": RefusalCount.count + stmt.excluded["count"]})
            for start in range(0, len(rows), CHUNK):
                await session.execute(stmt, rows[start:start + CHUNK])
            await session.commit()


RefusalTotals = dict[tuple[str, str], dict[tuple[str, str], int]]
"""(tenant id, key id) -> (scope, reason) -> refusals (of every tier)."""


async def refusal_totals(session: AsyncSession, *, tenant_ids: Sequence[str] | None,
                         start: datetime | None, end: datetime | None) -> RefusalTotals:
    """The refusals of `tenant_ids` (None: every tenant) in the UTC minutes that start in
    [start, end), per tenant and key, by scope and reason."""
    start_utc, end_utc = as_utc(start, "start"), as_utc(end, "end")
    if start_utc is not None and end_utc is not None and end_utc < start_utc:
        raise Invalid("end", "must not be before start")
    rc = RefusalCount
    stmt: Any = (select(rc.tenant_id, rc.api_key_id, rc.scope, rc.reason,
                        func.sum(rc.count).label("n"))
                 .group_by(rc.tenant_id, rc.api_key_id, rc.scope, rc.reason))
    if tenant_ids is not None:
        stmt = stmt.where(rc.tenant_id.in_(list(tenant_ids)))
    if start_utc is not None:
        stmt = stmt.where(rc.minute >= start_utc)
    if end_utc is not None:
        stmt = stmt.where(rc.minute < end_utc)
    totals: RefusalTotals = {}
    for r in (await session.execute(stmt)).all():
        totals.setdefault((r.tenant_id, r.api_key_id), {})[(r.scope, r.reason)] = int(r.n)
    return totals
