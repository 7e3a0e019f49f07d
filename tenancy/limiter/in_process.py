"""The in-process limiter backend (`InProcessLimiter`): plain dicts and deques for a single
gateway process, every operation under one `threading.Lock` with no ``await`` inside."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.limiter.base import (
    BUDGET_GRACE,
    CONC,
    DAY,
    MONTH,
    PENDING_TTL,
    RPM,
    TPM,
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
    duplicate,
    limits_of,
)
from lockgate.tenancy.limiter.decision import Header, Refusal, decide, grown
from lockgate.tenancy.limiter.periods import Periods, period_end
from lockgate.tenancy.validation import check_count


@dataclass(slots=True)
class ScopeState:
    """In-process counters of one scope (budgets are kept separately, per period)."""

    log: deque[tuple[float, str]] = field(default_factory=deque)  # (admitted at, request id)
    tokens: dict[str, int] = field(default_factory=dict)           # request id -> window tokens
    token_sum: int = 0
    leases: dict[str, float] = field(default_factory=dict)         # request id -> expires at

    def trim(self, now: float) -> None:
        """Drop window entries that left the window (admitted at or before now - WINDOW)."""
        cutoff = now - WINDOW
        while self.log and self.log[0][0] <= cutoff:
            _, rid = self.log.popleft()
            self.token_sum -= self.tokens.pop(rid, 0)

    def trim_leases(self, now: float) -> None:
        for rid in [r for r, exp in self.leases.items() if exp <= now]:
            del self.leases[rid]

    def requests_wait(self, count: int, limit: int, now: float) -> float:
        """Seconds until fewer than ``limit`` entries are in the window (``count`` of them now,
        the request being admitted included, if it is, as the newest)."""
        if count < limit:
            return 0.0
        idx = count - limit
        if idx >= len(self.log):
            return WINDOW
        return self.log[idx][0] + WINDOW - now

    def tokens_wait(self, total: int, target: int, now: float) -> float:
        """Seconds until the window's tokens drop from ``total`` to ``target`` or below."""
        if total <= target:
            return 0.0
        for t, rid in self.log:
            total -= self.tokens.get(rid, 0)
            if total <= target:
                return t + WINDOW - now
        return WINDOW

    @property
    def empty(self) -> bool:
        return not self.log and not self.leases


class InProcessLimiter(Limiter):
    """The limiter of a single gateway process (no Redis). ``clock`` returns epoch seconds;
    tests pass a fake one to travel in time."""

    def __init__(self, *, lease_ttl: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        self.lease_ttl = check_lease_ttl(lease_ttl)
        self._clock = clock
        self._lock = threading.Lock()
        self._scopes: dict[str, ScopeState] = {}
        self._budgets: dict[tuple[str, str], int] = {}   # (scope key, day or month) -> tokens
        self._pending: dict[str, float] = {}             # request id -> marker expiry
        self._cancelled: dict[str, float] = {}           # request id -> end of its window
        self._last_gc = -math.inf

    def _state(self, key: str) -> ScopeState:
        st = self._scopes.get(key)
        if st is None:
            st = self._scopes[key] = ScopeState()
        return st

    def _gc(self, now: float) -> None:
        """Forget expired markers, empty scopes and old budget periods (at most once a minute)."""
        if now - self._last_gc < WINDOW:
            return
        self._last_gc = now
        self._pending = {r: exp for r, exp in self._pending.items() if exp > now}
        self._cancelled = {r: end for r, end in self._cancelled.items() if end > now}
        for key in list(self._scopes):
            st = self._scopes[key]
            st.trim(now)
            st.trim_leases(now)
            if st.empty:
                del self._scopes[key]
        for bk in [k for k in self._budgets if period_end(k[1]) + BUDGET_GRACE <= now]:
            del self._budgets[bk]

    async def acquire(self, request_id: str, scopes: Sequence[LimitScope],
                      tokens: int) -> Decision:
        request_id = check_request_id(request_id)
        all_scopes = check_scopes(scopes)
        tokens = check_count(tokens, "tokens")
        with self._lock:
            now = float(self._clock())
            periods = Periods.at(now)
            limited = [s for s in all_scopes if not s.quota.unlimited]
            if not limited:
                return decide(request_id=request_id, scopes=all_scopes, limited=limited,
                              tokens=tokens, now=now, periods=periods, refusals=[], headers=[])
            self._gc(now)
            exp = self._pending.get(request_id)
            if exp is not None and exp > now:
                raise duplicate(request_id)
            if self._cancelled.get(request_id, -math.inf) > now:
                raise duplicate(request_id)
            refusals, counts = self._refusals(request_id, limited, tokens, now, periods)
            admitted = not refusals
            if admitted:
                self._admit(request_id, limited, tokens, now, periods)
            headers = self._headers(limited, counts, 1 if admitted else 0,
                                    tokens if admitted else 0, now)
            return decide(request_id=request_id, scopes=all_scopes, limited=limited,
                          tokens=tokens, now=now, periods=periods, refusals=refusals,
                          headers=headers)

    def _refusals(self, request_id: str, limited: list[LimitScope], tokens: int, now: float,
                  periods: Periods) -> tuple[list[Refusal], list[tuple[int, int]]]:
        """Every limit that refuses the request, and each scope's (requests, tokens) in its
        window before it; Invalid if the request id is still in a window."""
        refusals: list[Refusal] = []
        counts: list[tuple[int, int]] = []
        for i, s in enumerate(limited):
            rpm, tpm, conc, _, _ = limits_of(s.quota)
            st = self._state(s.counters)
            st.trim(now)
            if (rpm >= 0 or tpm >= 0) and request_id in st.tokens:
                raise duplicate(request_id)
            count, total = len(st.log), st.token_sum
            counts.append((count, total))
            if rpm >= 0 and count + 1 > rpm:
                wait = st.requests_wait(count, rpm, now) if rpm > 0 else None
                refusals.append(Refusal(i, RPM, wait, count))
            if tpm >= 0 and total + tokens > tpm:
                wait = st.tokens_wait(total, tpm - tokens, now) if tokens <= tpm else None
                refusals.append(Refusal(i, TPM, wait, total))
            if conc >= 0:
                st.trim_leases(now)
                c = len(st.leases)
                if c + 1 > conc:
                    wait = (min(st.leases.values()) - now) if conc > 0 else None
                    refusals.append(Refusal(i, CONC, wait, c))
            refusals += self._budget_refusals(i, s, tokens, periods, now)
        return refusals, counts

    def _budget_refusals(self, i: int, s: LimitScope, tokens: int, periods: Periods,
                         now: float) -> list[Refusal]:
        """The day and month budgets of scope `i` that have no room for `tokens` more."""
        _, _, _, dayb, monthb = limits_of(s.quota)
        refusals = []
        budgets = ((DAY, dayb, periods.day, periods.day_end),
                   (MONTH, monthb, periods.month, periods.month_end))
        for fld, budget, period, end in budgets:
            if budget >= 0:
                used = self._budgets.get((s.counters, period), 0)
                if used + tokens > budget:
                    wait = (end - now) if tokens <= budget else None
                    refusals.append(Refusal(i, fld, wait, used))
        return refusals

    async def reserve(self, lease: Lease, tokens: int) -> Decision:
        lease = check_lease(lease)
        tokens = check_count(tokens, "tokens")
        rid = lease.request_id
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        periods = Periods.at(lease.acquired_at)
        with self._lock:
            now = float(self._clock())
            if limited and self._pending.get(rid, -math.inf) <= now:
                raise Invalid("lease", f"the admission of {rid!r} is no longer unsettled")
            refusals: list[Refusal] = []
            counts: list[tuple[int, int]] = []
            for i, s in enumerate(limited):
                tpm = limits_of(s.quota)[TPM]
                st = self._state(s.counters)
                st.trim(now)
                total = st.token_sum
                counts.append((len(st.log), total))
                if tpm >= 0 and total + tokens > tpm:
                    wait = st.tokens_wait(total, tpm - tokens, now) if tokens <= tpm else None
                    refusals.append(Refusal(i, TPM, wait, total))
                refusals += self._budget_refusals(i, s, tokens, periods, now)
            if not refusals:
                for s in limited:
                    st = self._state(s.counters)
                    if rid in st.tokens:
                        st.tokens[rid] += tokens
                        st.token_sum += tokens
                    self._adjust_budgets(s, lease, tokens)
            headers = self._headers(limited, counts, 0, 0 if refusals else tokens, now)
            d = decide(request_id=rid, scopes=lease.scopes, limited=limited, tokens=tokens,
                       now=now, periods=periods, refusals=refusals, headers=headers)
            return grown(d, lease, tokens)

    def _admit(self, request_id: str, limited: list[LimitScope], tokens: int, now: float,
               periods: Periods) -> None:
        """Count an admitted request in every limit of every scope; mark it pending."""
        for s in limited:
            rpm, tpm, conc, dayb, monthb = limits_of(s.quota)
            st = self._state(s.counters)
            if rpm >= 0 or tpm >= 0:
                # Keep the log in time order should the clock step backwards.
                t = max(now, st.log[-1][0]) if st.log else now
                st.log.append((t, request_id))
                st.tokens[request_id] = tokens
                st.token_sum += tokens
            if conc >= 0:
                st.leases[request_id] = now + self.lease_ttl
            if dayb >= 0:
                k = (s.counters, periods.day)
                self._budgets[k] = self._budgets.get(k, 0) + tokens
            if monthb >= 0:
                k = (s.counters, periods.month)
                self._budgets[k] = self._budgets.get(k, 0) + tokens
        self._pending[request_id] = now + PENDING_TTL

    def _headers(self, limited: list[LimitScope], counts: list[tuple[int, int]],
                 dcount: int, dtokens: int, now: float) -> list[Header]:
        """Each scope's rate-limit header values, its window holding its `counts` plus
        `dcount` requests and `dtokens` tokens (what was just admitted or reserved)."""
        headers: list[Header] = []
        for i, s in enumerate(limited):
            rpm, tpm, _, _, _ = limits_of(s.quota)
            st = self._state(s.counters)
            count, total = counts[i]
            count, total = count + dcount, total + dtokens
            if rpm >= 0:
                reset = st.requests_wait(count, rpm, now) if rpm > 0 else None
                headers.append(Header(i, 0, rpm, max(0, rpm - count), reset))
            if tpm >= 0:
                reset = st.tokens_wait(total, tpm - 1, now) if tpm > 0 else None
                headers.append(Header(i, 1, tpm, max(0, tpm - total), reset))
        return headers

    def _end(self, lease: Lease, now: float) -> list[LimitScope]:
        """The start of settle and cancel (under the lock): consume the admission's pending
        marker and drop its concurrency leases. The lease's limited scopes when the admission
        was still unsettled, else [] (nothing more to adjust)."""
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        if not limited:
            return []
        exp = self._pending.pop(lease.request_id, None)
        for s in limited:
            st = self._scopes.get(s.counters)
            if st is not None:
                st.leases.pop(lease.request_id, None)
        return limited if exp is not None and exp > now else []

    def _adjust_budgets(self, scope: LimitScope, lease: Lease, delta: int) -> None:
        """Add `delta` tokens to the scope's day and month counters of the lease's periods."""
        _, _, _, dayb, monthb = limits_of(scope.quota)
        for budget, period in ((dayb, lease.day), (monthb, lease.month)):
            k = (scope.counters, period)
            if budget >= 0 and k in self._budgets:
                self._budgets[k] += delta

    async def settle(self, lease: Lease, used_tokens: int, budget_tokens: int | None = None) -> None:
        lease = check_lease(lease)
        used = check_count(used_tokens, "used_tokens")
        budget = used if budget_tokens is None else check_count(budget_tokens, "budget_tokens")
        with self._lock:
            now = float(self._clock())
            for s in self._end(lease, now):
                st = self._scopes.get(s.counters)
                if st is not None:
                    st.trim(now)
                    old = st.tokens.get(lease.request_id)
                    if old is not None:
                        st.tokens[lease.request_id] = used
                        st.token_sum += used - old
                self._adjust_budgets(s, lease, budget - lease.reserved_tokens)

    async def cancel(self, lease: Lease) -> None:
        lease = check_lease(lease)
        reserved = check_count(lease.reserved_tokens, "lease.reserved_tokens")
        with self._lock:
            now = float(self._clock())
            rid = lease.request_id
            for s in self._end(lease, now):
                st = self._scopes.get(s.counters)
                if st is not None:
                    st.trim(now)
                    old = st.tokens.pop(rid, None)
                    if old is not None:  # still in the window: take it out, keep its id taken
                        st.token_sum -= old
                        entry = next(e for e in st.log if e[1] == rid)
                        st.log.remove(entry)
                        end = max(self._cancelled.get(rid, -math.inf), entry[0] + WINDOW)
                        self._cancelled[rid] = end
                self._adjust_budgets(s, lease, -reserved)

    async def heartbeat(self, leases: Iterable[Lease]) -> None:
        leases = [check_lease(x) for x in leases]
        with self._lock:
            now = float(self._clock())
            for lease in leases:
                rid = lease.request_id
                if rid in self._pending and self._pending[rid] > now:
                    self._pending[rid] = now + PENDING_TTL
                for s in lease.scopes:
                    st = self._scopes.get(s.counters)
                    if st is not None and st.leases.get(rid, -math.inf) > now:
                        st.leases[rid] = now + self.lease_ttl

    async def live_usage(self, scope: LimitScope) -> ScopeUsage:
        scope = check_scope(scope)
        with self._lock:
            now = float(self._clock())
            periods = Periods.at(now)
            st = self._scopes.get(scope.counters) or ScopeState()
            cutoff = now - WINDOW
            live = [(t, rid) for t, rid in st.log if t > cutoff]
            holding = [t for t, rid in live if st.tokens.get(rid, 0) > 0]
            return ScopeUsage(
                requests_in_window=len(live),
                tokens_in_window=sum(st.tokens.get(rid, 0) for _, rid in live),
                concurrent=sum(1 for exp in st.leases.values() if exp > now),
                day_tokens=self._budgets.get((scope.counters, periods.day), 0),
                month_tokens=self._budgets.get((scope.counters, periods.month), 0),
                requests_reset_at=live[0][0] + WINDOW if live else None,
                tokens_reset_at=holding[0] + WINDOW if holding else None,
            )

    async def close(self) -> None:
        with self._lock:
            self._scopes.clear()
            self._budgets.clear()
            self._pending.clear()
            self._cancelled.clear()
