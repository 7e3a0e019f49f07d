"""The Redis limiter backend (`RedisLimiter`), shared by all gateway replicas: one ``EVALSHA``
of `limiter.lua` per acquire / reserve / settle / cancel, and per tag for heartbeat, on
Redis's own clock. Redis is one node, a Redis Cluster or Sentinel's master (`redis_conn`).

All keys are passed in ``KEYS``, every key of one call sharing one hash tag ``{T}``, the
request's tag (`tenancy.limiter.redis_keys`: the group of its first limited scope; on Redis Cluster
all its limited scopes must share it), and the time is taken from ``redis.call('TIME')``,
never from the caller. Per scope ``S`` of group ``T`` (``B`` = ``P{T}`` when ``S`` is ``T``
itself, else ``P{T}S``; ``P`` the prefix):

- ``B:win``   sorted set, member = request id, score = admission time (µs): the window log.
- ``B:tok``   hash, request id -> tokens of that window entry; field ``""`` holds the sum.
- ``B:lease`` sorted set, member = request id, score = lease expiry (µs).
- ``B:day:2026-11-29`` / ``B:month:2026-11``  token counters.
- ``P{T}:req:<request id>``  ``1``: marker of an unsettled admission (makes settlement and
  cancellation idempotent). ``0``: tombstone of a cancelled one, so that its id stays taken
  for as long as its window entry would have been in the window (as a settled one's is).
  ``r``: an admission the reconciler abandoned (`abandon`: reservation refunded), kept
  `REFUND_TTL` with ``P{T}:refund:<request id>``, its lease's description (for a row replayed
  later: `charge_replayed`). ``s``: charged once after a rebuild or a refund, nothing more to
  charge (`REFUND_TTL`). Request ids must be unique; a reused one is caught (Invalid) within
  its tag.
- ``P{T}:epoch``  ``H:time:nonce``: the tag's counters were rebuilt from the usage rows up to
  row id ``H`` (no expiry; `redis_epoch`). A tag without one is rebuilt before anything of it
  is admitted or settled.
- ``P{T}:pending`` sorted set, request id -> lease expiry (µs), renewed by heartbeats;
  ``P{T}:pending:info`` / ``P{T}:pending:res`` hashes, request id -> the lease's description
  (`describe_lease`) / its reserved tokens: the tag's unsettled admissions, so that
  `expired` finds those whose process died.
- ``Ppending-tags`` (no tag: a slot of its own) sorted set, tag -> when last registered (ms,
  its node's clock): the tags whose pending index may hold admissions. A limiter registers a
  tag before the first admission of it, and again `REGISTER_EVERY` seconds later (one small
  call per tag, per replica, per interval); `expired` drops a tag whose index it finds empty
  and nobody registered for `PRUNE_AFTER` seconds. So an `expired` pass costs one call for
  the registry and one per tag active in the last `PRUNE_AFTER` seconds (or with admissions
  still pending), run ``EXPIRED_BATCH`` at a time, each bounded by the timeout.

Window keys expire 61 s after the last admission, lease sets ``lease_ttl`` + 1 s after the
last write, counters a day after their period ends, markers `PENDING_TTL` after the last
admission or heartbeat, tombstones when the cancelled request's window entry would have.
The script ships as package data beside this module and is read once per process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from functools import cache
from importlib import resources
from time import monotonic
from typing import Any

from lockgate.tenancy.errors import Invalid, LimiterUnavailable
from lockgate.tenancy.limiter import redis_keys as K
from lockgate.tenancy.limiter.base import (
    BUDGET_GRACE,
    PENDING_TTL,
    WINDOW,
    Decision,
    Lease,
    Limiter,
    LimitScope,
    ScopeUsage,
    check_lease,
    check_lease_ttl,
    check_request_id,
    check_scope,
    check_scopes,
    describe_lease,
    duplicate,
    limits_of,
    parse_lease,
)
from lockgate.tenancy.limiter.decision import Header, Refusal, decide, grown
from lockgate.tenancy.limiter.periods import Periods
from lockgate.tenancy.limiter.rebuild import BudgetRebuilder
from lockgate.tenancy.limiter.redis_epoch import REFUND_MS, EpochMixin
from lockgate.tenancy.validation import check_count

_US = 1_000_000
REGISTER_EVERY = 60.0
"""A limiter registers a tag in the registry again after this many seconds, s."""
PRUNE_AFTER = 600.0
"""A tag with an empty pending index leaves the registry when nobody registered it for this
long, s (well past `REGISTER_EVERY`, so that no limiter still counts on its registration)."""
EXPIRED_BATCH = 64
"""The most tags `RedisLimiter.expired` asks about at once."""
logger = logging.getLogger(__name__)


@cache
def lua_source() -> str:
    """The limiter's Lua script (`tenancy/limiter/limiter.lua`)."""
    return resources.files("lockgate.tenancy.limiter").joinpath("limiter.lua").read_text(encoding="utf-8")


def _us(seconds: float) -> int:
    return round(seconds * _US)


class RedisLimiter(EpochMixin, Limiter):
    """The limiter shared by all gateway replicas, on one Redis (see the module docstring)."""

    def __init__(self, url: str, *, prefix: str = "lockgate:", lease_ttl: float = 30.0,
                 timeout: float = 0.25, rebuilder: BudgetRebuilder | None = None) -> None:
        """``url``: ``redis://``, ``rediss://``, ``unix://``, ``redis+cluster://`` or
        ``redis+sentinel://`` (`redis_conn`). ``timeout``: the most any wait on Redis may
        take (connect, each reply), seconds; past it the call raises LimiterUnavailable and
        the connection is dropped. ``rebuilder``: the usage rows a tag's lost budgets are
        rebuilt from (`redis_epoch`); without one they count on from what Redis holds."""
        from redis.exceptions import RedisError

        from lockgate.tenancy.limiter.redis_conn import connect
        from lockgate.tenancy.limiter.redis_pipe import RedisScript

        self.lease_ttl = check_lease_ttl(lease_ttl)
        self.prefix = K.check_prefix(prefix)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise Invalid("timeout", f"must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self._redis = connect(url, timeout=self.timeout)
        self._redis_error = RedisError
        # EVALSHA, sending the script again on NOSCRIPT (e.g. after a Redis restart).
        self._script = RedisScript(self._redis, lua_source())
        self._skew = 0.0  # Redis's clock minus ours, as last seen: to guess the UTC day
        self._registered: dict[str, float] = {}   # tag -> when we last registered it (monotonic)
        self.rebuilder = rebuilder
        self._rebuilds: dict[str, asyncio.Future[None]] = {}   # tag -> its rebuild under way

    @property
    def where(self) -> str:
        """Redis's address, for messages."""
        return self._redis.where

    async def _call(self, keys: list[str], args: list[Any]) -> Any:
        """One run of the script; any Redis failure is a LimiterUnavailable naming Redis."""
        try:
            return await self._script(keys=keys, args=args)
        except self._redis_error as exc:
            raise LimiterUnavailable(f"Redis at {self._redis.where}: {exc}") from exc

    def _tag(self, limited: Sequence[LimitScope]) -> str:
        return K.request_tag(limited, one_tag=self._redis.one_slot)

    async def _register(self, tag: str, *, again: bool = False) -> None:
        """Put ``tag`` in the registry `expired` walks, unless we did within REGISTER_EVERY
        (``again``: even so, as after the tag's keys were lost: the registry may have gone
        with them)."""
        now = monotonic()   # (not time.monotonic: tests replace `time` to skew the clock)
        if not again and now - self._registered.get(tag, -REGISTER_EVERY) < REGISTER_EVERY:
            return
        await self._call([K.registry(self.prefix)], ["register", tag])
        if len(self._registered) > 100_000:     # a bound on a long-lived replica's memory
            self._registered.clear()
        self._registered[tag] = now

    def _request_keys(self, request_id: str, limited: Sequence[LimitScope], tag: str,
                      day: str, month: str) -> list[str]:
        """A request's marker, its scopes' keys, its tag's pending index and epoch, and its
        refund description."""
        keys = [K.marker(self.prefix, tag, request_id)]
        for s in limited:
            keys += K.scope_keys(self.prefix, s, day, month)
        return [*keys, *K.pending_keys(self.prefix, tag), K.epoch(self.prefix, tag),
                K.refund(self.prefix, tag, request_id)]

    @staticmethod
    def _period_args(p: Periods) -> list[int]:
        return [_us(p.day_start), _us(p.day_end), _us(p.month_start), _us(p.month_end)]

    async def acquire(self, request_id: str, scopes: Sequence[LimitScope],
                      tokens: int) -> Decision:
        request_id = check_request_id(request_id)
        all_scopes = check_scopes(scopes)
        tokens = check_count(tokens, "tokens")
        limited = [s for s in all_scopes if not s.quota.unlimited]
        guess = time.time() + self._skew
        if not limited:  # nothing to count: no round trip
            return decide(request_id=request_id, scopes=all_scopes, limited=limited,
                          tokens=tokens, now=guess, periods=Periods.at(guess),
                          refusals=[], headers=[])
        tag = self._tag(limited)
        await self._register(tag)
        rebuilt = False
        for _ in range(5):
            p = Periods.at(guess)
            args: list[Any] = [
                "acquire", request_id, tokens, _us(WINDOW), _us(self.lease_ttl),
                int(PENDING_TTL * 1000),
                _us(p.day_start), _us(p.day_end), int((p.day_end + BUDGET_GRACE) * 1000),
                _us(p.month_start), _us(p.month_end), int((p.month_end + BUDGET_GRACE) * 1000),
                len(limited),
            ]
            for s in limited:
                args += limits_of(s.quota)
            # the lease's description, for the reconciler; its acquired_at is our guess of
            # Redis's clock (only its day and month matter, and those Redis checks)
            args.append(describe_lease(limited, p.day, p.month, guess))
            reply = await self._call(self._request_keys(request_id, limited, tag, p.day, p.month),
                                     args)
            status, now = reply[0], int(reply[1]) / _US
            if status == b"clock":  # Redis's clock is in another UTC day or month than ours
                self._skew = now - time.time()
                guess = now
                continue
            if status == b"rebuild" and not rebuilt:   # the tag's counters were lost
                await self._rebuild(tag, p)
                await self._register(tag, again=True)
                rebuilt = True
                continue
            if status == b"rebuild":
                raise LimiterUnavailable(f"the budgets of {tag} on Redis at {self.where} were "
                                         f"lost again while being rebuilt")
            if status == b"duplicate":
                raise duplicate(request_id)
            refusals, headers = _findings(reply)
            return decide(request_id=request_id, scopes=all_scopes, limited=limited,
                          tokens=tokens, now=now, periods=p, refusals=refusals, headers=headers,
                          epoch=reply[4].decode() if len(reply) > 4 else "")
        raise RuntimeError("could not agree with Redis on the current UTC day")

    async def _finish(self, lease: Lease, args: list[Any], tail: Sequence[Any] = ()) -> Any:
        """Run reserve, settle or cancel (``args``: the op and its arguments before the scope
        count; ``tail``: those after the scopes' limits) on the lease's limited scopes, in the
        periods it was charged to. None when no scope is limited."""
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        if not limited:
            return None
        tag = self._tag(limited)
        keys = self._request_keys(lease.request_id, limited, tag, lease.day, lease.month)
        args = [*args, len(limited)]
        for s in limited:
            args += limits_of(s.quota)
        for attempt in (0, 1):
            reply = await self._call(keys, [*args, *tail])
            if not (isinstance(reply, list) and reply and reply[0] == b"rebuild"):
                return reply
            if attempt:
                raise LimiterUnavailable(f"the budgets of {tag} on Redis at {self.where} were "
                                         f"lost again while being rebuilt")
            await self._rebuild(tag, Periods.at(time.time() + self._skew))
        return None

    async def reserve(self, lease: Lease, tokens: int) -> Decision:
        lease = check_lease(lease)
        tokens = check_count(tokens, "tokens")
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        p = Periods.at(lease.acquired_at)
        if p.day != lease.day or p.month != lease.month:
            raise Invalid("lease", "acquired_at is not in the lease's day and month")
        if limited:
            reply = await self._finish(lease, ["reserve", lease.request_id, tokens, _us(WINDOW),
                                               _us(p.day_end), _us(p.month_end)], [lease.epoch])
            if reply[0] == b"gone":
                raise Invalid("lease", f"the admission of {lease.request_id!r} is no longer "
                                       f"unsettled")
            now = int(reply[1]) / _US
            refusals, headers = _findings(reply)
        else:
            now, refusals, headers = lease.acquired_at, [], []
        d = decide(request_id=lease.request_id, scopes=lease.scopes, limited=limited,
                   tokens=tokens, now=now, periods=p, refusals=refusals, headers=headers)
        return grown(d, lease, tokens)

    async def settle(self, lease: Lease, used_tokens: int, budget_tokens: int | None = None) -> None:
        lease = check_lease(lease)
        used = check_count(used_tokens, "used_tokens")
        budget = used if budget_tokens is None else check_count(budget_tokens, "budget_tokens")
        head = ["settle", lease.request_id, used, lease.reserved_tokens, _us(WINDOW)]
        await self._settle_tail(lambda tail: self._finish(lease, head, [*tail, budget]), lease,
                                "settle", int(PENDING_TTL * 1000))

    async def abandon(self, lease: Lease) -> bool:
        lease = check_lease(lease)
        head = ["settle", lease.request_id, 0, lease.reserved_tokens, _us(WINDOW)]
        reply = await self._settle_tail(lambda tail: self._finish(lease, head, tail), lease,
                                        "abandon", int(PENDING_TTL * 1000))
        return reply == 1

    async def expired(self, limit: int = 100) -> list[Lease]:
        """The expired admissions of every registered tag (see the module docstring), at most
        ``limit``, those acquired first first."""
        limit = check_count(limit, "limit")
        tags = [t.decode() for t in await self._call([K.registry(self.prefix)], ["tags"])]
        await self._registry_lost(set(tags))
        leases: list[Lease] = []
        empty: list[str] = []
        for i in range(0, len(tags), EXPIRED_BATCH):
            batch = tags[i:i + EXPIRED_BATCH]
            replies = await asyncio.gather(*(self._call(K.pending_keys(self.prefix, t),
                                                        ["expired", limit]) for t in batch))
            for tag, reply in zip(batch, replies, strict=True):
                leases += self._parse_expired(reply[1])
                if int(reply[2]) == 0:
                    empty.append(tag)
        for tag in empty:   # only if nobody registered it again meanwhile (the script checks)
            await self._call([K.registry(self.prefix)], ["prune", tag, int(PRUNE_AFTER * 1000)])
        leases.sort(key=lambda lease: lease.acquired_at)
        return leases[:limit]

    async def _registry_lost(self, tags: set[str]) -> None:
        """A tag we registered within REGISTER_EVERY is missing from the registry only if the
        registry was lost (a restarted Redis, or on Cluster its node): then every tag is
        registered again at its next admission or heartbeat, those missing at once, so that
        the admissions made since are found when their process dies."""
        now = monotonic()
        missing = [t for t, when in self._registered.items()
                   if now - when < REGISTER_EVERY and t not in tags]
        if not missing:
            return
        logger.warning("the limiter's registry of tags on Redis at %s lost %d tag(s) this replica "
                       "registered; registering again", self.where, len(missing))
        self._registered.clear()
        for tag in missing:
            await self._register(tag)

    @staticmethod
    def _parse_expired(rows: list[Any]) -> list[Lease]:
        leases = []
        for rid, info, res in rows:
            try:
                leases.append(parse_lease(rid.decode(), info.decode(), int(res)))
            except (Invalid, ValueError):
                logger.error("pending admission %r has an unreadable description %r", rid, info)
        return leases

    async def cancel(self, lease: Lease) -> None:
        lease = check_lease(lease)
        reserved = check_count(lease.reserved_tokens, "lease.reserved_tokens")
        await self._finish(lease, ["cancel", lease.request_id, reserved, _us(WINDOW)],
                           [lease.epoch, REFUND_MS])

    async def heartbeat(self, leases: Iterable[Lease]) -> None:
        """One round trip per tag among ``leases`` (one on a single node's usual load: the
        calls of all tags are pipelined together)."""
        by_tag: dict[str, tuple[list[str], list[Any]]] = {}
        for lease in leases:
            lease = check_lease(lease)
            limited = [s for s in lease.scopes if not s.quota.unlimited]
            if not limited:
                continue
            tag = self._tag(limited)
            keys, args = by_tag.setdefault(tag, ([], []))
            await self._register(tag)   # a call only when not registered lately (or lost)
            lease_keys = [K.scope_key(self.prefix, s, "lease")
                          for s in limited if s.quota.max_concurrent_requests is not None]
            keys += [K.marker(self.prefix, tag, lease.request_id), *lease_keys]
            args += [lease.request_id, len(lease_keys)]
        await asyncio.gather(*(
            self._call([*keys, K.pending_keys(self.prefix, tag)[0]],
                       ["heartbeat", _us(self.lease_ttl), int(PENDING_TTL * 1000),
                        len(args) // 2, *args])
            for tag, (keys, args) in by_tag.items()))

    async def live_usage(self, scope: LimitScope) -> ScopeUsage:
        scope = check_scope(scope)
        guess = time.time() + self._skew
        for _ in range(4):
            p = Periods.at(guess)
            reply = await self._call(K.scope_keys(self.prefix, scope, p.day, p.month),
                                     ["usage", _us(WINDOW), *self._period_args(p)])
            if reply[0] == b"clock":
                guess = int(reply[1]) / _US
                self._skew = guess - time.time()
                continue
            req, tok, conc, day, month, req_at, tok_at = (int(x) for x in reply[2:9])
            return ScopeUsage(requests_in_window=req, tokens_in_window=tok, concurrent=conc,
                              day_tokens=day, month_tokens=month,
                              requests_reset_at=(req_at + _us(WINDOW)) / _US if req_at >= 0 else None,
                              tokens_reset_at=(tok_at + _us(WINDOW)) / _US if tok_at >= 0 else None)
        raise RuntimeError("could not agree with Redis on the current UTC day")

    async def check(self) -> str:
        """"ok" when Redis answers a PING within the timeout, else "unavailable"."""
        try:
            await self._redis.execute("PING")
        except self._redis_error:
            return "unavailable"
        return "ok"

    async def close(self) -> None:
        await self._redis.aclose()


def _findings(reply: list[Any]) -> tuple[list[Refusal], list[Header]]:
    """The refusals and header rows of an acquire or reserve reply."""
    refusals = [Refusal(int(si), int(f), None if int(w) < 0 else int(w) / _US, int(u))
                for si, f, w, u in reply[2]]
    headers = [Header(int(si), int(kind), int(lim), int(rem), None if int(r) < 0 else int(r) / _US)
               for si, kind, lim, rem, r in reply[3]]
    return refusals, headers
