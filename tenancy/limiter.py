"""Lockgate's rate and quota limiter: one meaning, two backends (in-process and Redis).

Every request is checked against a list of scopes (typically the tenant's quota and the API
key's quota). All limits of all scopes are checked and applied in one atomic step: if any of
them refuses, nothing changes anywhere. The limits (see `tenancy.quota.Quota`):

- ``requests_per_minute``: an exact sliding window: at most N admitted requests in any 60 s
  window (a log of admission times, not a fixed-window counter).
- ``tokens_per_minute``: an exact sliding window over tokens. An admitted request reserves
  ``tokens`` (prompt + max_tokens) at its admission time; settlement rewrites that entry to the
  tokens actually used, as long as the entry is still inside the window. A request whose
  reservation alone exceeds the limit can never pass and is told so.
- ``max_concurrent_requests``: leases. A lease counts until it is settled, or until it expires
  ``lease_ttl`` seconds after its last heartbeat (a replica that died stops heart-beating, so
  its leases free themselves).
- ``daily_token_budget`` / ``monthly_token_budget``: counters per UTC day / UTC month. The
  reservation is added at admission and adjusted by ``used - reserved`` at settlement, in the
  day and month the reservation was made in (recorded in the `Lease`), even after the period
  rolled over. Counters expire a day after their period ends.

A request the engine refused before doing any work (overloaded, shed from its queue) is
cancelled rather than settled: `Limiter.cancel` takes it back out of every window, lease and
budget as if it had never been admitted. Only an unsettled admission can be cancelled, and a
cancelled one can no longer be settled: cancel and settle both consume the admission's pending
marker, whichever comes first wins, and the other is a no-op.

Why this is written here rather than taken from the ``limits`` library: ``limits`` checks one
rate limit per call (``hit``/``test`` of one item), so checking the tenant's and the key's
quotas means several round trips with a window between them in which other replicas get in,
and a refusal by the second limit cannot undo the hit already taken by the first. It has no
notion of a reservation that is later settled to a different amount (tokens: prompt +
max_tokens reserved up front, rewritten to the tokens used), of concurrency leases that expire
without heartbeats, or of token budgets per calendar period adjusted after the fact. Lockgate
needs all of these decided together: one Lua script per admission (and one per settlement or
cancellation) that reads and writes every limit of every scope atomically, on Redis's own clock.

Backends:

- `InProcessLimiter`: plain dicts and deques, for a single gateway process. Each operation runs
  without an ``await`` inside its critical section (and under a `threading.Lock`, so calls
  from several threads or event loops are safe too). Its clock is injectable for tests.
- `RedisLimiter`: shared by all replicas. One ``EVALSHA`` per acquire / settle / cancel /
  heartbeat, all keys passed in ``KEYS`` (each scope's keys share a hash tag ``{scope}``), the
  time taken from ``redis.call('TIME')``, never from the caller. Per scope and prefix ``P``:

  - ``P{S}:win``   sorted set, member = request id, score = admission time (µs): the window log.
  - ``P{S}:tok``   hash, request id -> tokens of that window entry; field ``""`` holds the sum.
  - ``P{S}:lease`` sorted set, member = request id, score = lease expiry (µs).
  - ``P{S}:day:2026-11-29`` / ``P{S}:month:2026-11``  token counters.
  - ``Preq:<request id>``  ``1``: marker of an unsettled admission (makes settlement and
    cancellation idempotent). ``0``: tombstone of a cancelled one, so that its id stays taken
    for as long as its window entry would have been in the window (as a settled one's is).

  Window keys expire 61 s after the last admission, lease sets ``lease_ttl`` + 1 s after the
  last write, counters a day after their period ends, markers `PENDING_TTL` after the last
  admission or heartbeat, tombstones when the cancelled request's window entry would have.
  The Lua source lives in this module (not in a separate ``.lua`` file) so that it ships with
  the package without any package-data configuration.

A settlement or cancellation whose marker is gone (already settled or cancelled, or abandoned
for longer than `PENDING_TTL` without heartbeats) only drops the concurrency lease; the
reservation then stays charged to the budgets, the conservative choice.
"""

from __future__ import annotations

import math
import re
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from tenancy.quota import QUOTA_FIELDS, Quota

__all__ = [
    "CONCURRENCY_RETRY_HINT",
    "PENDING_TTL",
    "WINDOW",
    "Decision",
    "InProcessLimiter",
    "Lease",
    "Limiter",
    "LimiterUnavailable",
    "RedisLimiter",
    "Scope",
    "make_limiter",
]

WINDOW = 60.0
"""Length of the sliding windows of ``requests_per_minute`` and ``tokens_per_minute``, seconds."""

PENDING_TTL = 3600.0
"""How long an unsettled admission is remembered after its last admission or heartbeat, seconds.
Settling it later is a no-op for tokens and budgets."""

CONCURRENCY_RETRY_HINT = 1.0
"""Upper bound of ``retry_after`` for a concurrency refusal: any in-flight request may finish at
any moment, so the expiry of the oldest lease is only a worst case."""

BUDGET_GRACE = 86400.0
"""Day and month counters are kept this long after their period ends (late settlements)."""

_SCOPE_KEY = re.compile(r"^[A-Za-z0-9:_-]{1,200}$")
_MAX_REQUEST_ID = 256

RATE_LIMIT = "rate_limit_exceeded"
INSUFFICIENT_QUOTA = "insufficient_quota"

# Indices of the Quota fields, as used by the Lua script and the in-process mirror.
_RPM, _TPM, _CONC, _DAY, _MONTH = range(5)
assert QUOTA_FIELDS == (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "daily_token_budget",
    "monthly_token_budget",
)


# --------------------------------------------------------------------------------------------
# Public values
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scope:
    """One set of limits a request is counted against, e.g. a tenant or an API key.

    ``key`` names the counters (``"tenant:ten_123"``, ``"key:key_456"``): 1 to 200 characters
    of ``[A-Za-z0-9:_-]``.
    """

    key: str
    quota: Quota

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not _SCOPE_KEY.match(self.key):
            raise ValueError(
                f"scope.key: must be 1-200 characters of [A-Za-z0-9:_-], got {self.key!r}"
            )
        if not isinstance(self.quota, Quota):
            raise ValueError(f"scope.quota: must be a Quota, got {type(self.quota).__name__}")


@dataclass(frozen=True)
class Lease:
    """What an admitted request holds until it is settled.

    ``day`` and ``month`` are the UTC periods the reservation was charged to; settlement
    adjusts those counters whatever the date is by then.
    """

    request_id: str
    scopes: tuple[Scope, ...]
    reserved_tokens: int
    day: str
    month: str
    acquired_at: float


@dataclass(frozen=True)
class Decision:
    """The answer to `Limiter.acquire`.

    ``code`` is ``None`` when allowed, ``"rate_limit_exceeded"`` for requests/tokens per
    minute and concurrency, ``"insufficient_quota"`` for a daily or monthly budget. ``limit``
    is the Quota field that refused, ``scope`` the scope key. ``retry_after`` is the number of
    seconds until this request could pass (for budgets: until the next UTC day/month), or
    ``None`` when it can never pass.

    The ``*_requests`` / ``*_tokens`` fields feed OpenAI's ``x-ratelimit-*`` headers: they
    describe the tightest scope (least remaining) that has a requests (tokens) per minute
    limit, ``None`` where no scope has one. ``remaining_*`` are after this request's admission
    when allowed, the current state when refused; ``reset_*`` are the seconds until the window
    has room for one more request (token), ``None`` when the limit is 0.
    """

    allowed: bool
    lease: Lease | None
    code: str | None
    limit: str | None
    scope: str | None
    message: str
    retry_after: float | None
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests: float | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens: float | None


class LimiterUnavailable(RuntimeError):
    """The limiter's shared store cannot be reached or refused the call: nothing was decided
    (callers refuse the request rather than guess)."""


class Limiter(ABC):
    """Checks and applies the limits of several scopes atomically (see the module docstring)."""

    lease_ttl: float

    @abstractmethod
    async def acquire(self, request_id: str, scopes: Sequence[Scope], tokens: int) -> Decision:
        """Admit ``request_id`` reserving ``tokens`` in every scope, or refuse and change nothing.

        Raises ValueError for a bad argument, or a ``request_id`` that was already admitted
        (unsettled, or still in a sliding window): request ids must be unique.
        """

    @abstractmethod
    async def settle(self, lease: Lease, used_tokens: int) -> None:
        """End the request: release its concurrency lease, rewrite its tokens-per-minute entry
        (if still in the window) and its budget counters to ``used_tokens``. Idempotent, and a
        no-op after `cancel`."""

    @abstractmethod
    async def cancel(self, lease: Lease) -> None:
        """Undo the admission of a request the engine refused before it did any work: remove it
        from every scope's requests-per-minute window and tokens-per-minute sum, release its
        concurrency lease, and take its whole reservation back off the day/month budgets (of
        the periods it was charged to). Idempotent, and a no-op after `settle` (a settled
        request did work and stays counted). The request id stays unusable for a new acquire
        for as long as a settled one would be (ids are unique)."""

    @abstractmethod
    async def heartbeat(self, leases: Iterable[Lease]) -> None:
        """Extend the concurrency leases of requests still running (one round trip)."""

    @abstractmethod
    async def usage(self, scope: Scope) -> dict[str, int]:
        """Current counts of ``scope``: ``requests_in_window``, ``tokens_in_window``,
        ``concurrent``, ``day_tokens`` and ``month_tokens`` (current UTC day and month)."""

    @abstractmethod
    async def close(self) -> None:
        """Release the backend's resources."""


# --------------------------------------------------------------------------------------------
# Shared helpers: validation, calendar periods, building the Decision
# --------------------------------------------------------------------------------------------


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"{name}: must be >= 0, got {value}")
    return value


def _check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
    if len(request_id) > _MAX_REQUEST_ID:
        raise ValueError(f"request_id: at most {_MAX_REQUEST_ID} characters, got {len(request_id)}")
    return request_id


def _check_scopes(scopes: Sequence[Scope]) -> tuple[Scope, ...]:
    if isinstance(scopes, (str, bytes)) or not isinstance(scopes, Sequence):
        raise ValueError(f"scopes: must be a sequence of Scope, got {type(scopes).__name__}")
    seen: set[str] = set()
    for s in scopes:
        if not isinstance(s, Scope):
            raise ValueError(f"scopes: every item must be a Scope, got {type(s).__name__}")
        if s.key in seen:
            raise ValueError(f"scopes: scope key {s.key!r} appears twice")
        seen.add(s.key)
    return tuple(scopes)


def _duplicate(request_id: str) -> str:
    return (f"request_id: {request_id!r} was already admitted (unsettled, or still in the "
            f"{WINDOW:g} s window); request ids must be unique")


def _check_lease(lease: object) -> Lease:
    if not isinstance(lease, Lease):
        raise ValueError(f"lease: must be a Lease, got {type(lease).__name__}")
    return lease


@lru_cache(maxsize=4096)
def _limits(q: Quota) -> tuple[int, int, int, int, int]:
    """The quota's limits in field order, -1 for unlimited (the Lua script's encoding).
    Cached: a quota is frozen, and the same few go with every request of a tenant."""
    values = [getattr(q, f) for f in QUOTA_FIELDS]
    rpm, tpm, conc, day, month = (-1 if v is None else v for v in values)
    return rpm, tpm, conc, day, month


@dataclass(frozen=True)
class _Periods:
    """The UTC day and month containing an instant, with their bounds (epoch seconds)."""

    day: str
    day_start: float
    day_end: float
    month: str
    month_start: float
    month_end: float

    @classmethod
    def at(cls, ts: float) -> _Periods:
        last = _last_periods[0]
        if last is not None and last.day_start <= ts < last.day_end:
            return last       # the same UTC day (hence month) as the last call: most calls
        p = cls._compute(ts)
        _last_periods[0] = p
        return p

    @classmethod
    def _compute(cls, ts: float) -> _Periods:
        dt = datetime.fromtimestamp(ts, UTC)
        d0 = datetime(dt.year, dt.month, dt.day, tzinfo=UTC)
        m0 = datetime(dt.year, dt.month, 1, tzinfo=UTC)
        m1 = datetime(dt.year + (dt.month == 12), dt.month % 12 + 1, 1, tzinfo=UTC)
        return cls(
            day=d0.strftime("%Y-%m-%d"),
            day_start=d0.timestamp(),
            day_end=(d0 + timedelta(days=1)).timestamp(),
            month=m0.strftime("%Y-%m"),
            month_start=m0.timestamp(),
            month_end=m1.timestamp(),
        )


_last_periods: list[_Periods | None] = [None]


def _period_end(period: str) -> float:
    """End (epoch seconds) of a ``YYYY-MM-DD`` day or ``YYYY-MM`` month."""
    if len(period) == 10:
        d = datetime.strptime(period, "%Y-%m-%d").replace(tzinfo=UTC)
        return (d + timedelta(days=1)).timestamp()
    m = datetime.strptime(period, "%Y-%m").replace(tzinfo=UTC)
    return datetime(m.year + (m.month == 12), m.month % 12 + 1, 1, tzinfo=UTC).timestamp()


@dataclass(frozen=True)
class _Refusal:
    """One limit that refused: scope index (into the limited scopes), field index, seconds until
    it would admit this request (None: never), and its current use."""

    scope: int
    field: int
    retry: float | None
    used: int


@dataclass(frozen=True)
class _Header:
    """Rate-limit header values of one scope: kind 0 requests, 1 tokens."""

    scope: int
    kind: int
    limit: int
    remaining: int
    reset: float | None


def _message(r: _Refusal, scope: Scope, tokens: int, retry: float | None) -> str:
    """Human text naming the limit, its value, the scope and when to retry."""
    name = QUOTA_FIELDS[r.field]
    limit = getattr(scope.quota, name)
    key = scope.key
    wait = "" if retry is None else f" Retry in {retry:.2f} s."
    if r.field == _RPM:
        if r.retry is None:
            return f"requests_per_minute of {key} is {limit}: no request can pass."
        return (f"Rate limit reached for requests_per_minute of {key}: limit {limit} requests "
                f"per {WINDOW:g} s, {r.used} admitted in the current window.{wait}")
    if r.field == _TPM:
        if r.retry is None:
            return (f"This request reserves {tokens} tokens (prompt + max_tokens), more than the "
                    f"tokens_per_minute limit of {limit} of {key}: it can never pass. Lower "
                    f"max_tokens or shorten the prompt.")
        return (f"Rate limit reached for tokens_per_minute of {key}: limit {limit} tokens per "
                f"{WINDOW:g} s, {r.used} in the current window, this request reserves {tokens} "
                f"(prompt + max_tokens).{wait}")
    if r.field == _CONC:
        if r.retry is None:
            return f"max_concurrent_requests of {key} is {limit}: no request can pass."
        return (f"Too many concurrent requests for {key}: max_concurrent_requests is {limit} "
                f"and {r.used} are in flight.{wait}")
    period = "day" if r.field == _DAY else "month"
    if r.retry is None:
        return (f"This request reserves {tokens} tokens (prompt + max_tokens), more than the "
                f"{name} of {limit} of {key}: it can never pass. Lower max_tokens or shorten "
                f"the prompt.")
    return (f"Token budget exhausted: {name} of {key} is {limit}, {r.used} tokens used this UTC "
            f"{period}, this request reserves {tokens}. It resets at the start of the next UTC "
            f"{period}, in {retry:.0f} s.")


def _tightest(headers: list[_Header], kind: int) -> _Header | None:
    """The header of the scope with the least remaining (ties: the longest reset)."""
    hs = [h for h in headers if h.kind == kind]
    if not hs:
        return None
    return min(hs, key=lambda h: (h.remaining, -(math.inf if h.reset is None else h.reset)))


def _decide(
    *,
    request_id: str,
    scopes: tuple[Scope, ...],
    limited: list[Scope],
    tokens: int,
    now: float,
    periods: _Periods,
    refusals: list[_Refusal],
    headers: list[_Header],
) -> Decision:
    """Build the Decision from the raw findings of a backend (same for both backends)."""
    req = _tightest(headers, 0)
    tok = _tightest(headers, 1)
    hdr: dict[str, Any] = {
        "limit_requests": req.limit if req else None,
        "remaining_requests": req.remaining if req else None,
        "reset_requests": req.reset if req else None,
        "limit_tokens": tok.limit if tok else None,
        "remaining_tokens": tok.remaining if tok else None,
        "reset_tokens": tok.reset if tok else None,
    }
    if not refusals:
        lease = Lease(request_id=request_id, scopes=scopes, reserved_tokens=tokens,
                      day=periods.day, month=periods.month, acquired_at=now)
        return Decision(allowed=True, lease=lease, code=None, limit=None, scope=None,
                        message="ok", retry_after=None, **hdr)

    def retry_of(r: _Refusal) -> float | None:
        if r.retry is None:
            return None
        if r.field == _CONC:
            return min(r.retry, CONCURRENCY_RETRY_HINT)
        return r.retry

    # A limit that can never pass wins; otherwise the one that makes the request wait longest.
    never = [r for r in refusals if r.retry is None]
    worst = never[0] if never else max(refusals, key=lambda r: retry_of(r) or 0.0)
    scope = limited[worst.scope]
    retry = retry_of(worst)
    return Decision(
        allowed=False,
        lease=None,
        code=INSUFFICIENT_QUOTA if worst.field in (_DAY, _MONTH) else RATE_LIMIT,
        limit=QUOTA_FIELDS[worst.field],
        scope=scope.key,
        message=_message(worst, scope, tokens, retry),
        retry_after=retry,
        **hdr,
    )


# --------------------------------------------------------------------------------------------
# In-process backend
# --------------------------------------------------------------------------------------------


@dataclass
class _ScopeState:
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
    """The limiter of a single gateway process (no Redis). ``clock`` returns epoch seconds."""

    def __init__(self, *, lease_ttl: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(lease_ttl, (int, float)) or isinstance(lease_ttl, bool) or lease_ttl <= 0:
            raise ValueError(f"lease_ttl: must be a positive number of seconds, got {lease_ttl!r}")
        self.lease_ttl = float(lease_ttl)
        self._clock = clock
        self._lock = threading.Lock()
        self._scopes: dict[str, _ScopeState] = {}
        self._budgets: dict[tuple[str, str], int] = {}   # (scope key, day or month) -> tokens
        self._pending: dict[str, float] = {}             # request id -> marker expiry
        self._cancelled: dict[str, float] = {}           # request id -> end of its window
        self._last_gc = -math.inf

    def _state(self, key: str) -> _ScopeState:
        st = self._scopes.get(key)
        if st is None:
            st = self._scopes[key] = _ScopeState()
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
        for bk in [k for k in self._budgets if _period_end(k[1]) + BUDGET_GRACE <= now]:
            del self._budgets[bk]

    async def acquire(self, request_id: str, scopes: Sequence[Scope], tokens: int) -> Decision:
        request_id = _check_request_id(request_id)
        all_scopes = _check_scopes(scopes)
        tokens = _check_count("tokens", tokens)
        with self._lock:
            now = float(self._clock())
            periods = _Periods.at(now)
            limited = [s for s in all_scopes if not s.quota.unlimited]
            if not limited:
                return _decide(request_id=request_id, scopes=all_scopes, limited=limited,
                               tokens=tokens, now=now, periods=periods, refusals=[], headers=[])
            self._gc(now)
            exp = self._pending.get(request_id)
            if exp is not None and exp > now:
                raise ValueError(_duplicate(request_id))
            if self._cancelled.get(request_id, -math.inf) > now:
                raise ValueError(_duplicate(request_id))

            refusals: list[_Refusal] = []
            counts: list[tuple[int, int]] = []
            for i, s in enumerate(limited):
                rpm, tpm, conc, dayb, monthb = _limits(s.quota)
                st = self._state(s.key)
                st.trim(now)
                if (rpm >= 0 or tpm >= 0) and request_id in st.tokens:
                    raise ValueError(_duplicate(request_id))
                count, total = len(st.log), st.token_sum
                counts.append((count, total))
                if rpm >= 0 and count + 1 > rpm:
                    wait = st.requests_wait(count, rpm, now) if rpm > 0 else None
                    refusals.append(_Refusal(i, _RPM, wait, count))
                if tpm >= 0 and total + tokens > tpm:
                    wait = st.tokens_wait(total, tpm - tokens, now) if tokens <= tpm else None
                    refusals.append(_Refusal(i, _TPM, wait, total))
                if conc >= 0:
                    st.trim_leases(now)
                    c = len(st.leases)
                    if c + 1 > conc:
                        wait = (min(st.leases.values()) - now) if conc > 0 else None
                        refusals.append(_Refusal(i, _CONC, wait, c))
                budgets = ((_DAY, dayb, periods.day, periods.day_end),
                           (_MONTH, monthb, periods.month, periods.month_end))
                for fld, budget, period, end in budgets:
                    if budget >= 0:
                        used = self._budgets.get((s.key, period), 0)
                        if used + tokens > budget:
                            wait = (end - now) if tokens <= budget else None
                            refusals.append(_Refusal(i, fld, wait, used))

            admitted = not refusals
            if admitted:
                for s in limited:
                    rpm, tpm, conc, dayb, monthb = _limits(s.quota)
                    st = self._state(s.key)
                    if rpm >= 0 or tpm >= 0:
                        # Keep the log in time order should the clock step backwards.
                        t = max(now, st.log[-1][0]) if st.log else now
                        st.log.append((t, request_id))
                        st.tokens[request_id] = tokens
                        st.token_sum += tokens
                    if conc >= 0:
                        st.leases[request_id] = now + self.lease_ttl
                    if dayb >= 0:
                        k = (s.key, periods.day)
                        self._budgets[k] = self._budgets.get(k, 0) + tokens
                    if monthb >= 0:
                        k = (s.key, periods.month)
                        self._budgets[k] = self._budgets.get(k, 0) + tokens
                self._pending[request_id] = now + PENDING_TTL

            headers: list[_Header] = []
            for i, s in enumerate(limited):
                rpm, tpm, _, _, _ = _limits(s.quota)
                st = self._state(s.key)
                count, total = counts[i]
                if admitted:
                    count, total = count + 1, total + tokens
                if rpm >= 0:
                    reset = st.requests_wait(count, rpm, now) if rpm > 0 else None
                    headers.append(_Header(i, 0, rpm, max(0, rpm - count), reset))
                if tpm >= 0:
                    reset = st.tokens_wait(total, tpm - 1, now) if tpm > 0 else None
                    headers.append(_Header(i, 1, tpm, max(0, tpm - total), reset))
            return _decide(request_id=request_id, scopes=all_scopes, limited=limited,
                           tokens=tokens, now=now, periods=periods, refusals=refusals,
                           headers=headers)

    def _end(self, lease: Lease, now: float) -> list[Scope]:
        """The start of settle and cancel (under the lock): consume the admission's pending
        marker and drop its concurrency leases. The lease's limited scopes when the admission
        was still unsettled, else [] (nothing more to adjust)."""
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        if not limited:
            return []
        exp = self._pending.pop(lease.request_id, None)
        for s in limited:
            st = self._scopes.get(s.key)
            if st is not None:
                st.leases.pop(lease.request_id, None)
        return limited if exp is not None and exp > now else []

    def _adjust_budgets(self, scope: Scope, lease: Lease, delta: int) -> None:
        """Add `delta` tokens to the scope's day and month counters of the lease's periods."""
        _, _, _, dayb, monthb = _limits(scope.quota)
        for budget, period in ((dayb, lease.day), (monthb, lease.month)):
            k = (scope.key, period)
            if budget >= 0 and k in self._budgets:
                self._budgets[k] += delta

    async def settle(self, lease: Lease, used_tokens: int) -> None:
        lease = _check_lease(lease)
        used = _check_count("used_tokens", used_tokens)
        with self._lock:
            now = float(self._clock())
            for s in self._end(lease, now):
                st = self._scopes.get(s.key)
                if st is not None:
                    st.trim(now)
                    old = st.tokens.get(lease.request_id)
                    if old is not None:
                        st.tokens[lease.request_id] = used
                        st.token_sum += used - old
                self._adjust_budgets(s, lease, used - lease.reserved_tokens)

    async def cancel(self, lease: Lease) -> None:
        lease = _check_lease(lease)
        reserved = _check_count("lease.reserved_tokens", lease.reserved_tokens)
        with self._lock:
            now = float(self._clock())
            rid = lease.request_id
            for s in self._end(lease, now):
                st = self._scopes.get(s.key)
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
        leases = [_check_lease(x) for x in leases]
        with self._lock:
            now = float(self._clock())
            for lease in leases:
                rid = lease.request_id
                if rid in self._pending and self._pending[rid] > now:
                    self._pending[rid] = now + PENDING_TTL
                for s in lease.scopes:
                    st = self._scopes.get(s.key)
                    if st is not None and st.leases.get(rid, -math.inf) > now:
                        st.leases[rid] = now + self.lease_ttl

    async def usage(self, scope: Scope) -> dict[str, int]:
        if not isinstance(scope, Scope):
            raise ValueError(f"scope: must be a Scope, got {type(scope).__name__}")
        with self._lock:
            now = float(self._clock())
            periods = _Periods.at(now)
            st = self._scopes.get(scope.key) or _ScopeState()
            cutoff = now - WINDOW
            live = [rid for t, rid in st.log if t > cutoff]
            return {
                "requests_in_window": len(live),
                "tokens_in_window": sum(st.tokens.get(rid, 0) for rid in live),
                "concurrent": sum(1 for exp in st.leases.values() if exp > now),
                "day_tokens": self._budgets.get((scope.key, periods.day), 0),
                "month_tokens": self._budgets.get((scope.key, periods.month), 0),
            }

    async def close(self) -> None:
        with self._lock:
            self._scopes.clear()
            self._budgets.clear()
            self._pending.clear()
            self._cancelled.clear()


# --------------------------------------------------------------------------------------------
# Redis backend
# --------------------------------------------------------------------------------------------

# KEYS layout for acquire, settle and cancel: [marker, then per limited scope: win, tok, lease,
# day, month].
# Per-scope limits in ARGV: rpm, tpm, conc, day, month (-1 = unlimited). Times are integer
# microseconds (TIME), passed to Redis commands through fmt() so large numbers are never
# written in exponent notation.
_LUA = r"""
local op = ARGV[1]

local function fmt(x) return string.format('%d', x) end

local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Drop window entries admitted at or before cutoff, and their tokens from the sum.
local function trim_window(win, tok, cutoff)
  local old = redis.call('ZRANGEBYSCORE', win, '-inf', fmt(cutoff))
  if #old == 0 then return end
  local freed = 0
  for i = 1, #old do
    local v = redis.call('HGET', tok, old[i])
    if v then
      freed = freed + tonumber(v)
      redis.call('HDEL', tok, old[i])
    end
  end
  redis.call('ZREMRANGEBYSCORE', win, '-inf', fmt(cutoff))
  if freed ~= 0 then redis.call('HINCRBY', tok, '', fmt(-freed)) end
end

-- Time until fewer than `limit` entries are in the window, `count` being in it now (the
-- request just admitted, if any, is the newest).
local function requests_wait(win, count, limit, now, window)
  if count < limit then return 0 end
  local idx = count - limit
  local e = redis.call('ZRANGE', win, idx, idx, 'WITHSCORES')
  if #e == 0 then return window end
  return tonumber(e[2]) + window - now
end

-- Time until the window's tokens drop from `total` to `target` or below, oldest leaving first.
local function tokens_wait(win, tok, total, target, now, window)
  if total <= target then return 0 end
  local start = 0
  while true do
    local page = redis.call('ZRANGE', win, start, start + 127, 'WITHSCORES')
    if #page == 0 then return window end
    for j = 1, #page, 2 do
      total = total - (tonumber(redis.call('HGET', tok, page[j])) or 0)
      if total <= target then return tonumber(page[j + 1]) + window - now end
    end
    start = start + 128
  end
end

local function limits(base)
  return tonumber(ARGV[base + 1]), tonumber(ARGV[base + 2]), tonumber(ARGV[base + 3]),
         tonumber(ARGV[base + 4]), tonumber(ARGV[base + 5])
end

-- The start of settle and cancel: consume rid's marker and drop its concurrency leases. True
-- when the admission was still unsettled (the marker was there, not gone nor a tombstone).
local function finish(rid, n, base)
  local live = redis.call('GET', KEYS[1]) == '1'
  if live then redis.call('DEL', KEYS[1]) end
  for i = 1, n do
    local _, _, conc = limits(base + (i - 1) * 5)
    if conc >= 0 then redis.call('ZREM', KEYS[1 + (i - 1) * 5 + 3], rid) end
  end
  return live
end

if op == 'acquire' then
  local rid = ARGV[2]
  local tokens = tonumber(ARGV[3])
  local window = tonumber(ARGV[4])
  local ttl = tonumber(ARGV[5])
  local pending_ms = ARGV[6]
  local day_start, day_end = tonumber(ARGV[7]), tonumber(ARGV[8])
  local day_expire_ms = ARGV[9]
  local month_start, month_end = tonumber(ARGV[10]), tonumber(ARGV[11])
  local month_expire_ms = ARGV[12]
  local n = tonumber(ARGV[13])
  local now = clock()
  if now < day_start or now >= day_end or now < month_start or now >= month_end then
    return {'clock', now}
  end
  if redis.call('EXISTS', KEYS[1]) == 1 then return {'duplicate', now} end

  local refusals, counts, sums = {}, {}, {}
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, conc, dayb, monthb = limits(13 + (i - 1) * 5)
    local count, sum = 0, 0
    if rpm >= 0 or tpm >= 0 then
      trim_window(KEYS[k + 1], KEYS[k + 2], now - window)
      -- request ids are unique: one still in the window cannot be admitted again
      if redis.call('ZSCORE', KEYS[k + 1], rid) then return {'duplicate', now} end
      count = redis.call('ZCARD', KEYS[k + 1])
      sum = tonumber(redis.call('HGET', KEYS[k + 2], '') or '0')
    end
    counts[i], sums[i] = count, sum
    if rpm >= 0 and count + 1 > rpm then
      local wait = -1
      if rpm > 0 then wait = requests_wait(KEYS[k + 1], count, rpm, now, window) end
      refusals[#refusals + 1] = {i - 1, 0, wait, count}
    end
    if tpm >= 0 and sum + tokens > tpm then
      local wait = -1
      if tokens <= tpm then
        wait = tokens_wait(KEYS[k + 1], KEYS[k + 2], sum, tpm - tokens, now, window)
      end
      refusals[#refusals + 1] = {i - 1, 1, wait, sum}
    end
    if conc >= 0 then
      redis.call('ZREMRANGEBYSCORE', KEYS[k + 3], '-inf', fmt(now))
      local c = redis.call('ZCARD', KEYS[k + 3])
      if c + 1 > conc then
        local wait = -1
        if conc > 0 then
          local first = redis.call('ZRANGE', KEYS[k + 3], 0, 0, 'WITHSCORES')
          wait = tonumber(first[2]) - now
        end
        refusals[#refusals + 1] = {i - 1, 2, wait, c}
      end
    end
    if dayb >= 0 then
      local used = tonumber(redis.call('GET', KEYS[k + 4]) or '0')
      if used + tokens > dayb then
        local wait = -1
        if tokens <= dayb then wait = day_end - now end
        refusals[#refusals + 1] = {i - 1, 3, wait, used}
      end
    end
    if monthb >= 0 then
      local used = tonumber(redis.call('GET', KEYS[k + 5]) or '0')
      if used + tokens > monthb then
        local wait = -1
        if tokens <= monthb then wait = month_end - now end
        refusals[#refusals + 1] = {i - 1, 4, wait, used}
      end
    end
  end

  local admitted = #refusals == 0
  if admitted then
    local window_ms = fmt(window / 1000 + 1000)
    local lease_ms = fmt(ttl / 1000 + 1000)
    for i = 1, n do
      local k = 1 + (i - 1) * 5
      local rpm, tpm, conc, dayb, monthb = limits(13 + (i - 1) * 5)
      if rpm >= 0 or tpm >= 0 then
        redis.call('ZADD', KEYS[k + 1], fmt(now), rid)
        redis.call('HSET', KEYS[k + 2], rid, ARGV[3])
        redis.call('HINCRBY', KEYS[k + 2], '', ARGV[3])
        redis.call('PEXPIRE', KEYS[k + 1], window_ms)
        redis.call('PEXPIRE', KEYS[k + 2], window_ms)
      end
      if conc >= 0 then
        redis.call('ZADD', KEYS[k + 3], fmt(now + ttl), rid)
        redis.call('PEXPIRE', KEYS[k + 3], lease_ms)
      end
      if dayb >= 0 then
        redis.call('INCRBY', KEYS[k + 4], ARGV[3])
        redis.call('PEXPIREAT', KEYS[k + 4], day_expire_ms)
      end
      if monthb >= 0 then
        redis.call('INCRBY', KEYS[k + 5], ARGV[3])
        redis.call('PEXPIREAT', KEYS[k + 5], month_expire_ms)
      end
    end
    redis.call('SET', KEYS[1], '1', 'PX', pending_ms)
  end

  local headers = {}
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm = limits(13 + (i - 1) * 5)
    local count, sum = counts[i], sums[i]
    if admitted then count, sum = count + 1, sum + tokens end
    if rpm >= 0 then
      local reset = -1
      if rpm > 0 then reset = requests_wait(KEYS[k + 1], count, rpm, now, window) end
      headers[#headers + 1] = {i - 1, 0, rpm, math.max(0, rpm - count), reset}
    end
    if tpm >= 0 then
      local reset = -1
      if tpm > 0 then reset = tokens_wait(KEYS[k + 1], KEYS[k + 2], sum, tpm - 1, now, window) end
      headers[#headers + 1] = {i - 1, 1, tpm, math.max(0, tpm - sum), reset}
    end
  end
  if admitted then return {'ok', now, refusals, headers} end
  return {'refused', now, refusals, headers}

elseif op == 'settle' then
  local rid = ARGV[2]
  local used = tonumber(ARGV[3])
  local delta = fmt(used - tonumber(ARGV[4]))
  local window = tonumber(ARGV[5])
  local n = tonumber(ARGV[6])
  local now = clock()
  if not finish(rid, n, 6) then return 0 end
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, conc, dayb, monthb = limits(6 + (i - 1) * 5)
    if rpm >= 0 or tpm >= 0 then
      trim_window(KEYS[k + 1], KEYS[k + 2], now - window)
      if redis.call('ZSCORE', KEYS[k + 1], rid) then
        local old = tonumber(redis.call('HGET', KEYS[k + 2], rid)) or 0
        redis.call('HSET', KEYS[k + 2], rid, ARGV[3])
        redis.call('HINCRBY', KEYS[k + 2], '', fmt(used - old))
      end
    end
    -- A counter that is gone belongs to a period long over: nothing to adjust (and
    -- recreating it would leave a key without a TTL).
    if dayb >= 0 and redis.call('EXISTS', KEYS[k + 4]) == 1 then
      redis.call('INCRBY', KEYS[k + 4], delta)
    end
    if monthb >= 0 and redis.call('EXISTS', KEYS[k + 5]) == 1 then
      redis.call('INCRBY', KEYS[k + 5], delta)
    end
  end
  return 1

elseif op == 'cancel' then
  -- ARGV: rid, reserved tokens, window, n, then the limits of each scope.
  local rid = ARGV[2]
  local reserved = ARGV[3]
  local window = tonumber(ARGV[4])
  local n = tonumber(ARGV[5])
  local now = clock()
  if not finish(rid, n, 5) then return 0 end
  local admitted = nil
  for i = 1, n do
    local k = 1 + (i - 1) * 5
    local rpm, tpm, conc, dayb, monthb = limits(5 + (i - 1) * 5)
    if rpm >= 0 or tpm >= 0 then
      trim_window(KEYS[k + 1], KEYS[k + 2], now - window)
      local t = redis.call('ZSCORE', KEYS[k + 1], rid)
      if t then
        admitted = tonumber(t)
        local old = tonumber(redis.call('HGET', KEYS[k + 2], rid)) or 0
        redis.call('ZREM', KEYS[k + 1], rid)
        redis.call('HDEL', KEYS[k + 2], rid)
        redis.call('HINCRBY', KEYS[k + 2], '', fmt(-old))
      end
    end
    if dayb >= 0 and redis.call('EXISTS', KEYS[k + 4]) == 1 then
      redis.call('DECRBY', KEYS[k + 4], reserved)
    end
    if monthb >= 0 and redis.call('EXISTS', KEYS[k + 5]) == 1 then
      redis.call('DECRBY', KEYS[k + 5], reserved)
    end
  end
  -- It was in a window: its id stays taken until that entry would have left it.
  if admitted then
    redis.call('SET', KEYS[1], '0', 'PX', fmt(math.ceil((admitted + window - now) / 1000)))
  end
  return 1

elseif op == 'heartbeat' then
  -- KEYS: per lease: marker, then its lease sets. ARGV: ttl, pending_ms, n, then per lease:
  -- request id, number of lease sets.
  local ttl = tonumber(ARGV[2])
  local pending_ms = ARGV[3]
  local n = tonumber(ARGV[4])
  local now = clock()
  local lease_ms = fmt(ttl / 1000 + 1000)
  local k, a, extended = 1, 5, 0
  for _ = 1, n do
    local rid, m = ARGV[a], tonumber(ARGV[a + 1])
    if redis.call('GET', KEYS[k]) == '1' then redis.call('PEXPIRE', KEYS[k], pending_ms) end
    for j = 1, m do
      local key = KEYS[k + j]
      local exp = tonumber(redis.call('ZSCORE', key, rid))
      if exp and exp > now then
        redis.call('ZADD', key, 'XX', fmt(now + ttl), rid)
        redis.call('PEXPIRE', key, lease_ms)
        extended = extended + 1
      end
    end
    k, a = k + 1 + m, a + 2
  end
  return extended

elseif op == 'usage' then
  -- KEYS: win, tok, lease, day, month. Read-only.
  local window = tonumber(ARGV[2])
  local now = clock()
  if now < tonumber(ARGV[3]) or now >= tonumber(ARGV[4])
     or now < tonumber(ARGV[5]) or now >= tonumber(ARGV[6]) then
    return {'clock', now}
  end
  local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. fmt(now - window), '+inf')
  local tokens = 0
  for i = 1, #live do
    tokens = tokens + (tonumber(redis.call('HGET', KEYS[2], live[i])) or 0)
  end
  local conc = redis.call('ZCOUNT', KEYS[3], '(' .. fmt(now), '+inf')
  local day = tonumber(redis.call('GET', KEYS[4]) or '0')
  local month = tonumber(redis.call('GET', KEYS[5]) or '0')
  return {'ok', now, #live, tokens, conc, day, month}
end
return redis.error_reply('lockgate limiter: unknown op ' .. tostring(op))
"""

_US = 1_000_000


def _us(seconds: float) -> int:
    return int(round(seconds * _US))


class RedisLimiter(Limiter):
    """The limiter shared by all gateway replicas, on one Redis (see the module docstring)."""

    def __init__(self, url: str, *, prefix: str = "lockgate:", lease_ttl: float = 30.0) -> None:
        from redis.exceptions import RedisError

        from tenancy.redis_pipe import RedisPipe, RedisScript

        if not isinstance(lease_ttl, (int, float)) or isinstance(lease_ttl, bool) or lease_ttl <= 0:
            raise ValueError(f"lease_ttl: must be a positive number of seconds, got {lease_ttl!r}")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix: must be a string, got {prefix!r}")
        self.lease_ttl = float(lease_ttl)
        self.prefix = prefix
        self._redis = RedisPipe(url)
        self._redis_error = RedisError
        # EVALSHA, sending the script again on NOSCRIPT (e.g. after a Redis restart).
        self._script = RedisScript(self._redis, _LUA)
        self._skew = 0.0  # Redis's clock minus ours, as last seen: to guess the UTC day

    async def _call(self, keys: list[str], args: list[Any]) -> Any:
        """One run of the script; any Redis failure is a LimiterUnavailable naming Redis."""
        try:
            return await self._script(keys=keys, args=args)
        except self._redis_error as exc:
            raise LimiterUnavailable(f"Redis at {self._redis.where}: {exc}") from exc

    def _scope_keys(self, scope: Scope, day: str, month: str) -> list[str]:
        base = f"{self.prefix}{{{scope.key}}}"
        return [f"{base}:win", f"{base}:tok", f"{base}:lease", f"{base}:day:{day}",
                f"{base}:month:{month}"]

    def _marker(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    @staticmethod
    def _period_args(p: _Periods) -> list[int]:
        return [_us(p.day_start), _us(p.day_end), _us(p.month_start), _us(p.month_end)]

    async def acquire(self, request_id: str, scopes: Sequence[Scope], tokens: int) -> Decision:
        request_id = _check_request_id(request_id)
        all_scopes = _check_scopes(scopes)
        tokens = _check_count("tokens", tokens)
        limited = [s for s in all_scopes if not s.quota.unlimited]
        guess = time.time() + self._skew
        if not limited:  # nothing to count: no round trip
            return _decide(request_id=request_id, scopes=all_scopes, limited=limited,
                           tokens=tokens, now=guess, periods=_Periods.at(guess),
                           refusals=[], headers=[])
        for _ in range(4):
            p = _Periods.at(guess)
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
                args += _limits(s.quota)
            reply = await self._call(keys, args)
            status, now = reply[0], int(reply[1]) / _US
            if status == b"clock":  # Redis's clock is in another UTC day or month than ours
                self._skew = now - time.time()
                guess = now
                continue
            if status == b"duplicate":
                raise ValueError(_duplicate(request_id))
            refusals = [
                _Refusal(int(si), int(f), None if int(w) < 0 else int(w) / _US, int(u))
                for si, f, w, u in reply[2]
            ]
            headers = [
                _Header(int(si), int(kind), int(lim), int(rem),
                        None if int(r) < 0 else int(r) / _US)
                for si, kind, lim, rem, r in reply[3]
            ]
            return _decide(request_id=request_id, scopes=all_scopes, limited=limited,
                           tokens=tokens, now=now, periods=p, refusals=refusals, headers=headers)
        raise RuntimeError("could not agree with Redis on the current UTC day")

    async def _finish(self, lease: Lease, args: list[Any]) -> None:
        """Run settle or cancel (``args``: the op and its arguments before the scope count) on
        the lease's limited scopes, in the periods it was charged to."""
        limited = [s for s in lease.scopes if not s.quota.unlimited]
        if not limited:
            return
        keys = [self._marker(lease.request_id)]
        args = [*args, len(limited)]
        for s in limited:
            keys += self._scope_keys(s, lease.day, lease.month)
            args += _limits(s.quota)
        await self._call(keys, args)

    async def settle(self, lease: Lease, used_tokens: int) -> None:
        lease = _check_lease(lease)
        used = _check_count("used_tokens", used_tokens)
        await self._finish(lease, ["settle", lease.request_id, used, lease.reserved_tokens,
                                   _us(WINDOW)])

    async def cancel(self, lease: Lease) -> None:
        lease = _check_lease(lease)
        reserved = _check_count("lease.reserved_tokens", lease.reserved_tokens)
        await self._finish(lease, ["cancel", lease.request_id, reserved, _us(WINDOW)])

    async def heartbeat(self, leases: Iterable[Lease]) -> None:
        keys: list[str] = []
        args: list[Any] = []
        n = 0
        for lease in leases:
            lease = _check_lease(lease)
            limited = [s for s in lease.scopes if not s.quota.unlimited]
            if not limited:
                continue
            lease_keys = [self._scope_keys(s, lease.day, lease.month)[2]
                          for s in limited if s.quota.max_concurrent_requests is not None]
            keys += [self._marker(lease.request_id), *lease_keys]
            args += [lease.request_id, len(lease_keys)]
            n += 1
        if n:
            await self._call(keys, ["heartbeat", _us(self.lease_ttl), int(PENDING_TTL * 1000),
                                    n, *args])

    async def usage(self, scope: Scope) -> dict[str, int]:
        if not isinstance(scope, Scope):
            raise ValueError(f"scope: must be a Scope, got {type(scope).__name__}")
        guess = time.time() + self._skew
        for _ in range(4):
            p = _Periods.at(guess)
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

    async def close(self) -> None:
        await self._redis.aclose()


def make_limiter(redis_url: str | None, **kw: Any) -> Limiter:
    """A `RedisLimiter` on ``redis_url``, or an `InProcessLimiter` when it is None or empty.

    ``kw`` goes to the constructor (``lease_ttl``; ``prefix`` for Redis, ignored in-process;
    ``clock`` in-process only).
    """
    if redis_url:
        return RedisLimiter(redis_url, **kw)
    kw.pop("prefix", None)
    return InProcessLimiter(**kw)
