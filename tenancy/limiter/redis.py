"""The Redis limiter backend (`RedisLimiter`), shared by all gateway replicas: one ``EVALSHA``
of `limiter.lua` per acquire / settle / cancel / heartbeat, on Redis's own clock.

All keys are passed in ``KEYS`` (each scope's keys share a hash tag ``{scope}``), and the time
is taken from ``redis.call('TIME')``, never from the caller. Per scope ``S`` and prefix ``P``:

- ``P{S}:win``   sorted set, member = request id, score = admission time (µs): the window log.
- ``P{S}:tok``   hash, request id -> tokens of that window entry; field ``""`` holds the sum.
- ``P{S}:lease`` sorted set, member = request id, score = lease expiry (µs).
- ``P{S}:day:2026-11-29`` / ``P{S}:month:2026-11``  token counters.
- ``Preq:<request id>``  ``1``: marker of an unsettled admission (makes settlement and
  cancellation idempotent). ``0``: tombstone of a cancelled one, so that its id stays taken
  for as long as its window entry would have been in the window (as a settled one's is).
  ``r``: an admission the reconciler abandoned (`abandon`: reservation refunded).
- ``Ppending`` sorted set, request id -> lease expiry (µs), renewed by heartbeats;
  ``Ppending:info`` / ``Ppending:res`` hashes, request id -> the lease's description
  (`describe_lease`) / its reserved tokens: the unsettled admissions, so that `expired` finds
  those whose process died.

Window keys expire 61 s after the last admission, lease sets ``lease_ttl`` + 1 s after the
last write, counters a day after their period ends, markers `PENDING_TTL` after the last
admission or heartbeat, tombstones when the cancelled request's window entry would have.
The script ships as package data beside this module and is read once per process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from functools import cache
from importlib import resources
from typing import Any

from tenancy.errors import Invalid, LimiterUnavailable
from tenancy.limiter.base import (
    BUDGET_GRACE,
    PENDING_TTL,
    WINDOW,
    Decision,
    Lease,
    Limiter,
    LimitScope,
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
from tenancy.limiter.decision import Header, Refusal, decide, grown
from tenancy.limiter.periods import Periods
from tenancy.validation import check_count

_US = 1_000_000
logger = logging.getLogger(__name__)


@cache
def lua_source() -> str:
    """The limiter's Lua script (`tenancy/limiter/limiter.lua`)."""
    return resources.files("tenancy.limiter").joinpath("limiter.lua").read_text(encoding="utf-8")


def _us(seconds: float) -> int:
    return round(seconds * _US)


class RedisLimiter(Limiter):
    """The limiter shared by all gateway replicas, on one Redis (see the module docstring)."""

    def __init__(self, url: str, *, prefix: str = "lockgate:", lease_ttl: float = 30.0,
                 timeout: float = 0.25) -> None:
        """``timeout``: the most any wait on Redis may take (connect, each reply), seconds;
        past it the call raises LimiterUnavailable and the connection is dropped."""
        from redis.exceptions import RedisError

        from tenancy.limiter.redis_pipe import RedisPipe, RedisScript

        self.lease_ttl = check_lease_ttl(lease_ttl)
        if not isinstance(prefix, str):
            raise Invalid("prefix", f"must be a string, got {prefix!r}")
        self.prefix = prefix
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise Invalid("timeout", f"must be a positive number of seconds, got {timeout!r}")
        self.timeout = float(timeout)
        self._redis = RedisPipe(url, timeout=self.timeout)
        self._redis_error = RedisError
        # EVALSHA, sending the script again on NOSCRIPT (e.g. after a Redis restart).
        self._script = RedisScript(self._redis, lua_source())
        self._skew = 0.0  # Redis's clock minus ours, as last seen: to guess the UTC day

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

    def _scope_keys(self, scope: LimitScope, day: str, month: str) -> list[str]:
        base = f"{self.prefix}{{{scope.key}}}"
        return [f"{base}:win", f"{base}:tok", f"{base}:lease", f"{base}:day:{day}",
                f"{base}:month:{month}"]

    def _marker(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def _pending_keys(self) -> list[str]:
        return [f"{self.prefix}pending", f"{self.prefix}pending:info", f"{self.prefix}pending:res"]

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
        for _ in range(4):
            p = Periods.at(guess)
            keys = [self._marker(request_id)]
            args: list[Any] = [
                "acquire", request_id, tokens, _us(WINDOW), _us(self.lease_ttl),
                int(PENDING_TTL * 1000),
                _us(p.day_start), _us(p.day_end), int((p.day_end + BUDGET_GRACE) * 1000),
                _us(p.month_start), _us(p.month_end), int((p.month_end + BUDGET_GRACE) * 1000),
                len(limited),
            ]
            for s in limited:
                keys += self._scope_keys(s, p.day, p.month)
                args += limits_of(s.quota)
            keys += self._pending_keys()
            # the lease's description, for the reconciler; its acquired_at is our guess of
            # Redis's clock (only its day and month matter, and those Redis checks)
            args.append(describe_lease(limited, p.day, p.month, guess))
            reply = await self._call(keys, args)
            status, now = reply[0], int(reply[1]) / _US
            if status == b"clock":  # Redis's clock is in another UTC day or month than ours
                self._skew = now - time.time()
                guess = now
                continue
            if status == b"duplicate":
                raise duplicate(request_id)
            refusals = [
                Refusal(int(si), int(f), None if int(w) < 0 else int(w) / _US, int(u))
                for si, f, w, u in reply[2]
            ]
            headers = [
                Header(int(si), int(kind), int(lim), int(rem),
                       None if int(r) < 0 else int(r) / _US)
                for si, kind, lim, rem, r in reply[3]
            ]
            return decide(request_id=request_id, scopes=all_scopes, limited=limited,
                          tokens=tokens, now=now, periods=p, refusals=refusals, headers=headers)
        raise RuntimeError("could not agree with Redis on the current UTC day")

    async def _finish(self, lease: Lease, args: list[Any], tail: Sequence[Any] = ()) -> Any:
        """Run reserve, settle or cancel (``args``: the op and its arguments before the scope
        count; ``tail``: those after the scopes' limits) on the lease's limited scopes, in the
        periods it was charged to. None when no scope is limited."""
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        if not limited:
            return None
        keys = [self._marker(lease.request_id)]
        args = [*args, len(limited)]
        for s in limited:
            keys += self._scope_keys(s, lease.day, lease.month)
            args += limits_of(s.quota)
        return await self._call(keys + self._pending_keys(), [*args, *tail])

    async def reserve(self, lease: Lease, tokens: int) -> Decision:
        lease = check_lease(lease)
        tokens = check_count(tokens, "tokens")
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        p = Periods.at(lease.acquired_at)
        if p.day != lease.day or p.month != lease.month:
            raise Invalid("lease", "acquired_at is not in the lease's day and month")
        if limited:
            reply = await self._finish(lease, ["reserve", lease.request_id, tokens, _us(WINDOW),
                                               _us(p.day_end), _us(p.month_end)])
            if reply[0] == b"gone":
                raise Invalid("lease", f"the admission of {lease.request_id!r} is no longer "
                                       f"unsettled")
            now = int(reply[1]) / _US
            refusals = [Refusal(int(si), int(f), None if int(w) < 0 else int(w) / _US, int(u))
                        for si, f, w, u in reply[2]]
            headers = [Header(int(si), int(kind), int(lim), int(rem),
                              None if int(r) < 0 else int(r) / _US)
                       for si, kind, lim, rem, r in reply[3]]
        else:
            now, refusals, headers = lease.acquired_at, [], []
        d = decide(request_id=lease.request_id, scopes=lease.scopes, limited=limited,
                   tokens=tokens, now=now, periods=p, refusals=refusals, headers=headers)
        return grown(d, lease, tokens)

    async def settle(self, lease: Lease, used_tokens: int) -> None:
        lease = check_lease(lease)
        used = check_count(used_tokens, "used_tokens")
        await self._finish(lease, ["settle", lease.request_id, used, lease.reserved_tokens,
                                   _us(WINDOW)], ["settle", int(PENDING_TTL * 1000)])

    async def abandon(self, lease: Lease) -> bool:
        lease = check_lease(lease)
        reply = await self._finish(lease, ["settle", lease.request_id, 0, lease.reserved_tokens,
                                           _us(WINDOW)], ["abandon", int(PENDING_TTL * 1000)])
        return reply == 1

    async def expired(self, limit: int = 100) -> list[Lease]:
        limit = check_count(limit, "limit")
        reply = await self._call(self._pending_keys(), ["expired", limit])
        leases = []
        for rid, info, res in reply[1]:
            try:
                leases.append(parse_lease(rid.decode(), info.decode(), int(res)))
            except (Invalid, ValueError):
                logger.error("pending admission %r has an unreadable description %r", rid, info)
        return leases

    async def cancel(self, lease: Lease) -> None:
        lease = check_lease(lease)
        reserved = check_count(lease.reserved_tokens, "lease.reserved_tokens")
        await self._finish(lease, ["cancel", lease.request_id, reserved, _us(WINDOW)])

    async def heartbeat(self, leases: Iterable[Lease]) -> None:
        keys: list[str] = []
        args: list[Any] = []
        n = 0
        for lease in leases:
            lease = check_lease(lease)
            limited = [s for s in lease.scopes if not s.quota.unlimited]
            if not limited:
                continue
            lease_keys = [self._scope_keys(s, lease.day, lease.month)[2]
                          for s in limited if s.quota.max_concurrent_requests is not None]
            keys += [self._marker(lease.request_id), *lease_keys]
            args += [lease.request_id, len(lease_keys)]
            n += 1
        if n:
            await self._call([*keys, self._pending_keys()[0]],
                             ["heartbeat", _us(self.lease_ttl), int(PENDING_TTL * 1000), n, *args])

    async def usage(self, scope: LimitScope) -> dict[str, int]:
        scope = check_scope(scope)
        guess = time.time() + self._skew
        for _ in range(4):
            p = Periods.at(guess)
            reply = await self._call(self._scope_keys(scope, p.day, p.month),
                                     ["usage", _us(WINDOW), *self._period_args(p)])
            if reply[0] == b"clock":
                guess = int(reply[1]) / _US
                self._skew = guess - time.time()
                continue
            req, tok, conc, day, month = (int(x) for x in reply[2:7])
            return {"requests_in_window": req, "tokens_in_window": tok, "concurrent": conc,
                    "day_tokens": day, "month_tokens": month}
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
