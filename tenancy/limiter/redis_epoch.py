"""The Redis limiter's epochs (`EpochMixin`, part of `RedisLimiter`): budgets that survive
losing Redis.

Each tag has an epoch key ``P{T}:epoch`` (`redis_keys.epoch`), set when the tag's day and month
counters were rebuilt from the usage rows (`rebuild.BudgetRebuilder`) and kept without expiry.
Redis restarting empty, or a Cluster node coming back without its slots, loses the epoch with
the counters; every admission, reservation, settlement and cancellation of that tag then
answers 'rebuild', and the limiter rebuilds the tag (once per process at a time), sets the
epoch and tries the call once more. The database unreachable, the call raises
`LimiterUnavailable` naming the rebuild: never an admission against counters read as zero.

An admission carries the epoch it was made in (`Lease.epoch`). One from before the current
epoch holds nothing on any counter (the rebuild counted rows, not reservations): it is
*stale*. Its settlement charges its used tokens unless the rebuild already counted its row
(`BudgetRebuilder.counted`: its row id is at most the epoch's high-water mark); its
cancellation, reservation and abandonment charge nothing. The marker 's' makes that charge
happen once, whoever settles it and however often.

A usage row replayed from a replica's spool (`charge_replayed`) is charged when no counter
holds its tokens: its admission was refunded by the reconciler (marker 'r', the lease's
description beside it), or it finished before the current epoch, had no marker left, and
the rebuild did not count it.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from lockgate.tenancy.errors import Invalid, LimiterUnavailable
from lockgate.tenancy.limiter import redis_keys as K
from lockgate.tenancy.limiter.base import BUDGET_GRACE, REFUND_TTL, Lease, ReplayedRow, parse_lease
from lockgate.tenancy.limiter.periods import Periods
from lockgate.tenancy.limiter.rebuild import BudgetRebuilder, Totals, key_scope_key, tenant_scope_key

logger = logging.getLogger(__name__)

_US = 1_000_000
REFUND_MS = int(REFUND_TTL * 1000)
_REPLAY_BATCH = 64


def high_water(epoch: str) -> int:
    """The highest usage row id the rebuild of ``epoch`` (``H:time:nonce``) counted."""
    return int(epoch.split(":", 1)[0])


def epoch_time(epoch: str) -> float:
    """When ``epoch`` was set, on its node's clock, epoch seconds."""
    return int(epoch.split(":")[1]) / _US


class EpochMixin:
    """Rebuilds, stale settlements and replayed rows, for `RedisLimiter`."""

    prefix: str
    rebuilder: BudgetRebuilder | None
    _rebuilds: dict[str, asyncio.Future[None]]
    _call: Callable[[list[str], list[Any]], Awaitable[Any]]

    @property
    def where(self) -> str:
        raise NotImplementedError

    async def _rebuild(self, tag: str, p: Periods) -> None:
        """Rebuild ``tag``'s counters for ``p`` unless a rebuild of it is under way here."""
        task = self._rebuilds.get(tag)
        if task is None:
            task = asyncio.ensure_future(self._rebuild_tag(tag, p))
            self._rebuilds[tag] = task
            task.add_done_callback(lambda _: self._rebuilds.pop(tag, None))
        await asyncio.shield(task)

    async def _rebuild_tag(self, tag: str, p: Periods) -> None:
        if self.rebuilder is None:      # a limiter without a database: the counters as they are
            logger.info("limiter tag %s on Redis at %s has no epoch and no database to rebuild "
                           "its budgets from: they count from what Redis holds", tag, self.where)
            totals = Totals(0)
        else:
            try:
                totals = await self.rebuilder.totals(tag, p)
            except Exception as exc:  # any database failure: no admission on lost counters
                raise LimiterUnavailable(f"the budgets of {tag} were lost with Redis at {self.where} "
                                         f"and cannot be rebuilt from the usage rows: {exc!r}") from exc
        keys = [K.epoch(self.prefix, tag)]
        args: list[Any] = ["rebuild", totals.high_water, secrets.token_hex(4)]
        day_expiry, month_expiry = int((p.day_end + BUDGET_GRACE) * 1000), int((p.month_end + BUDGET_GRACE) * 1000)
        for key, day in totals.day.items():
            base = K.counter_base(self.prefix, tag, key)
            keys += [f"{base}:day:{p.day}", f"{base}:month:{p.month}"]
            args += [day, day_expiry, totals.month.get(key, 0), month_expiry]
        epoch = (await self._call(keys, args)).decode()
        if self.rebuilder is not None:
            logger.warning("limiter tag %s had no epoch on Redis at %s: its budgets for %s and %s "
                           "were rebuilt from the usage rows (up to row %d; epoch %s)", tag, self.where,
                           p.day, p.month, totals.high_water, epoch)

    async def _finding(self, request_id: str, epoch: str) -> str:
        """'counted' when the rebuild of ``epoch`` counted the request's row, else 'charge'
        (also when the database cannot say: a row written now is not counted, and billing a
        used token twice is the lesser error than not at all)."""
        if self.rebuilder is None:
            return "charge"
        try:
            return "counted" if await self.rebuilder.counted(request_id, high_water(epoch)) else "charge"
        except Exception as exc:  # noqa: BLE001 - any database failure: charged, logged
            logger.warning("could not tell whether the rebuild counted the row of %s (%r): charged",
                           request_id, exc)
            return "charge"

    async def _settle_tail(self, finish: Callable[[list[Any]], Awaitable[Any]], lease: Lease,
                           mode: str, pending_ms: int) -> Any:
        """Run a settle (``mode`` 'settle' or 'abandon') through ``finish`` (called with the
        arguments after the scopes' limits), answering the script's 'stale' with the row's
        finding; a few tries when the epoch keeps changing, then LimiterUnavailable."""
        finding = against = ""
        for _ in range(3):
            reply = await finish([mode, pending_ms, lease.epoch, finding, against, REFUND_MS])
            if not (isinstance(reply, list) and reply and reply[0] == b"stale"):
                return reply
            against = reply[1].decode()
            finding = await self._finding(lease.request_id, against)
        raise LimiterUnavailable(f"the limiter epoch of {lease.request_id!r} kept changing on "
                                 f"Redis at {self.where}")

    async def charge_replayed(self, rows: Sequence[ReplayedRow]) -> int:
        charged = 0
        for i in range(0, len(rows), _REPLAY_BATCH):     # pipelined, a batch at a time
            charged += sum(await asyncio.gather(*(self._charge_one(r) for r in rows[i:i + _REPLAY_BATCH])))
        if charged:
            logger.warning("%d usage row(s) replayed from a spool charged to the budgets (their "
                           "admissions were refunded, or lost with Redis)", charged)
        return charged

    async def _charge_one(self, row: ReplayedRow) -> int:
        try:
            return await self._charge(row)
        except Invalid as exc:
            logger.error("replayed row %s: unreadable refund description (%s)", row.request_id, exc)
            return 0

    async def _charge(self, row: ReplayedRow) -> int:
        tag = tenant_scope_key(row.tenant_id)
        head = [K.marker(self.prefix, tag, row.request_id), K.epoch(self.prefix, tag),
                K.refund(self.prefix, tag, row.request_id)]
        marker, epoch, info = (x.decode() for x in await self._call(head, ["peek"]))
        if marker == "r" and info:
            lease = parse_lease(row.request_id, info, 0)
            scopes = [(s.group, s.key) for s in lease.scopes]
            day, month = lease.day, lease.month
            against = ""
        elif (not marker and epoch and row.created_at < epoch_time(epoch)
              and await self._finding(row.request_id, epoch) == "charge"):
            p = Periods.at(row.created_at)
            scopes = [(tag, tag), (tag, key_scope_key(row.api_key_id))]
            day, month, against = p.day, p.month, epoch
        else:
            return 0
        keys = [k for group, key in scopes for base in [K.counter_base(self.prefix, group, key)]
                for k in (f"{base}:day:{day}", f"{base}:month:{month}")]
        return int(await self._call([*head, *keys], ["replayed", row.tokens, marker, against, REFUND_MS]))
