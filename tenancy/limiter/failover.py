"""`FailoverLimiter`: the Redis limiter with a defined behaviour while Redis fails.

Every call to Redis is bounded by its timeout (`RedisLimiter`, `redis_pipe`). The first one
that fails (down, or hung past the timeout) starts an *outage*, logged once; a background task
then PINGs Redis every ``retry_interval`` and ends the outage when Redis answers and the
queued settlements are applied (logged once). During an outage no request waits on Redis:

- ``acquire``: closed (no ``fallback``) raises `LimiterUnavailable` at once (the gateway's 503
  ``limiter_unavailable``); open decides with the ``fallback`` in-process limiter, so every
  replica enforces each quota on its own (a tenant may get up to replicas x quota) until Redis
  answers. A lease admitted by the fallback is settled, cancelled and heart-beaten there.
- ``settle`` / ``cancel`` of a Redis lease never raise for Redis and never wait on it: they
  go to a bounded queue (``max_queued``; when full the oldest entry is dropped, logged: its
  lease then expires after ``lease_ttl`` and its reservation stays charged, the conservative
  side). Both are idempotent on Redis, so an entry whose first attempt timed out after
  running is safe to apply again.
- ``heartbeat`` skips Redis (its leases may expire meanwhile; concurrency undercounts then).
- ``check`` (for `/ready`) answers from the outage state at once: "unavailable" (closed) or
  "degraded" (open); otherwise it PINGs within the timeout.

``counts`` (outages, fallback decisions, settlements queued and dropped) are plain integers
for the gateway's metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lockgate.tenancy.errors import Invalid, LimiterUnavailable
from lockgate.tenancy.limiter.base import Decision, Lease, Limiter, LimitScope, ReplayedRow, ScopeUsage
from lockgate.tenancy.limiter.in_process import InProcessLimiter
from lockgate.tenancy.limiter.redis import RedisLimiter
from lockgate.tenancy.validation import check_count

logger = logging.getLogger(__name__)

_DRAIN_BATCH = 64


@dataclass(frozen=True, slots=True)
class _Pending:
    """A settlement or cancellation Redis has not taken yet."""

    op: str             # "settle" or "cancel"
    lease: Lease
    used: int
    budget: int | None = None

    async def run(self, limiter: Limiter) -> None:
        if self.op == "settle":
            await limiter.settle(self.lease, self.used, self.budget)
        else:
            await limiter.cancel(self.lease)


class FailoverLimiter(Limiter):
    """`primary` while Redis answers; refusals (closed) or `fallback` (open) while it fails."""

    def __init__(self, primary: RedisLimiter, *, fallback: InProcessLimiter | None = None,
                 max_queued: int = 10_000, retry_interval: float | None = None) -> None:
        self.primary = primary
        self.fallback = fallback
        self.lease_ttl = primary.lease_ttl
        if check_count(max_queued, "max_queued") < 1:
            raise Invalid("max_queued", f"must be at least 1, got {max_queued}")
        self.max_queued = max_queued
        self.retry_interval = retry_interval if retry_interval is not None else primary.timeout
        if self.retry_interval <= 0:
            raise Invalid("retry_interval", f"must be a positive number of seconds, got {retry_interval!r}")
        self.counts = {"outages": 0, "fallback_decisions": 0, "settlements_queued": 0,
                       "settlements_dropped": 0}
        self._local: set[str] = set()            # request ids the fallback admitted
        self._queue: deque[_Pending] = deque()
        self._down_since: float | None = None
        self._recovery: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        """Settlements and cancellations waiting for Redis."""
        return len(self._queue)

    @property
    def down(self) -> bool:
        return self._down_since is not None

    async def acquire(self, request_id: str, scopes: Sequence[LimitScope], tokens: int) -> Decision:
        if self._down_since is None:
            try:
                return await self.primary.acquire(request_id, scopes, tokens)
            except LimiterUnavailable as exc:
                self._outage(exc)
                if self.fallback is None:
                    raise
        if self.fallback is None:
            raise LimiterUnavailable(f"Redis at {self.primary.where} has not answered for "
                                     f"{time.monotonic() - (self._down_since or 0):.1f} s")
        decision = await self.fallback.acquire(request_id, scopes, tokens)
        self.counts["fallback_decisions"] += 1
        if decision.lease is not None:
            self._local.add(request_id)
        return decision

    async def reserve(self, lease: Lease, tokens: int) -> Decision:
        """On the backend that admitted ``lease``; a Redis lease while Redis fails raises
        `LimiterUnavailable` (the caller settles the admission, which is queued)."""
        if self.fallback is not None and lease.request_id in self._local:
            return await self.fallback.reserve(lease, tokens)
        if self._down_since is not None:
            raise LimiterUnavailable(f"Redis at {self.primary.where} is not answering")
        try:
            return await self.primary.reserve(lease, tokens)
        except LimiterUnavailable as exc:
            self._outage(exc)
            raise

    async def expired(self, limit: int = 100) -> list[Lease]:
        """Redis's expired admissions; none while Redis fails (the reconciler waits)."""
        if self._down_since is not None:
            return []
        try:
            return await self.primary.expired(limit)
        except LimiterUnavailable as exc:
            self._outage(exc)
            return []

    async def abandon(self, lease: Lease) -> bool:
        if self._down_since is not None:
            return False
        try:
            return await self.primary.abandon(lease)
        except LimiterUnavailable as exc:
            self._outage(exc)
            return False

    async def charge_replayed(self, rows: Sequence[ReplayedRow]) -> int:
        """On Redis; while Redis fails the charges are not made (logged: the rows are in the
        database, and the budget is short of them)."""
        if self._down_since is None:
            try:
                return await self.primary.charge_replayed(rows)
            except LimiterUnavailable as exc:
                self._outage(exc)
        logger.error("Redis at %s is not answering: %d replayed usage row(s) not checked for a "
                     "refunded reservation to charge", self.primary.where, len(rows))
        return 0

    async def settle(self, lease: Lease, used_tokens: int, budget_tokens: int | None = None) -> None:
        if self.fallback is not None and lease.request_id in self._local:
            self._local.discard(lease.request_id)
            await self.fallback.settle(lease, used_tokens, budget_tokens)
            return
        budget = None if budget_tokens is None else check_count(budget_tokens, "budget_tokens")
        await self._finish(_Pending("settle", lease, check_count(used_tokens, "used_tokens"), budget))

    async def cancel(self, lease: Lease) -> None:
        if self.fallback is not None and lease.request_id in self._local:
            self._local.discard(lease.request_id)
            await self.fallback.cancel(lease)
            return
        await self._finish(_Pending("cancel", lease, 0))

    async def _finish(self, pending: _Pending) -> None:
        if self._down_since is None:
            try:
                await pending.run(self.primary)
                return
            except LimiterUnavailable as exc:
                self._outage(exc)
        self._enqueue(pending)

    def _enqueue(self, pending: _Pending) -> None:
        if len(self._queue) >= self.max_queued:
            dropped = self._queue.popleft()
            self.counts["settlements_dropped"] += 1
            logger.warning("limiter settlement queue full (%d): dropped the %s of request %s; its "
                           "lease expires by itself, its reservation stays charged",
                           self.max_queued, dropped.op, dropped.lease.request_id)
        self._queue.append(pending)
        self.counts["settlements_queued"] += 1

    async def heartbeat(self, leases: Iterable[Lease]) -> None:
        local: list[Lease] = []
        remote: list[Lease] = []
        for lease in leases:
            (local if lease.request_id in self._local else remote).append(lease)
        if local and self.fallback is not None:
            await self.fallback.heartbeat(local)
        if remote and self._down_since is None:
            try:
                await self.primary.heartbeat(remote)
            except LimiterUnavailable as exc:
                self._outage(exc)

    async def live_usage(self, scope: LimitScope) -> ScopeUsage:
        return await self.primary.live_usage(scope)

    async def check(self) -> str:
        if self._down_since is None:
            if await self.primary.check() == "ok":
                return "ok"
            self._outage(LimiterUnavailable(f"Redis at {self.primary.where} did not answer a PING"))
        return "unavailable" if self.fallback is None else "degraded"

    # -- the outage ---------------------------------------------------------------------------
    def _outage(self, exc: LimiterUnavailable) -> None:
        """Start an outage (once): log it, count it, and start the recovery task."""
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        self.counts["outages"] += 1
        meanwhile = ("new requests are admitted by this replica's in-process limiter (limits per "
                     "replica)" if self.fallback is not None else
                     "new requests are refused (503 limiter_unavailable)")
        logger.warning("Redis at %s does not answer (%s): %s until it does; settlements are "
                       "queued", self.primary.where, exc, meanwhile)
        self._recovery = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        """PING every `retry_interval` until Redis answers and the queue is applied."""
        while True:
            await asyncio.sleep(self.retry_interval)
            try:
                if await self.primary.check() == "ok" and await self._drain():
                    break
            except Exception:  # any failure, logged: the outage must end once Redis answers
                logger.exception("limiter recovery check failed; retrying")
        took = time.monotonic() - (self._down_since or 0)
        self._down_since = None
        self._recovery = None
        logger.warning("Redis at %s answers again after %.1f s: limits are shared again",
                       self.primary.where, took)

    async def _drain(self) -> bool:
        """Apply the queued settlements; False (the rest kept, in order) if Redis fails again."""
        while self._queue:
            batch = [self._queue.popleft() for _ in range(min(_DRAIN_BATCH, len(self._queue)))]
            results = await asyncio.gather(*(p.run(self.primary) for p in batch),
                                           return_exceptions=True)
            failed = []
            for pending, result in zip(batch, results, strict=True):
                if isinstance(result, LimiterUnavailable):
                    failed.append(pending)
                elif isinstance(result, Exception):     # a bad entry: retrying cannot help
                    logger.error("queued %s of request %s failed: %r", pending.op,
                                 pending.lease.request_id, result)
            if failed:
                self._queue.extendleft(reversed(failed))
                return False
        return True

    async def close(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
            self._recovery = None
        if self._queue and await self.primary.check() == "ok":
            await self._drain()
        if self._queue:
            logger.warning("%d limiter settlements could not be applied at shutdown (Redis at "
                           "%s): their leases expire by themselves", len(self._queue),
                           self.primary.where)
        await self.primary.close()
        if self.fallback is not None:
            await self.fallback.close()
