"""The limiter's interface and values: `Limiter`, `LimitScope`, `Lease`, `Decision`, the
window and lease constants, and the argument checks both backends share."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TypedDict

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.quota import QUOTA_FIELDS, Quota

WINDOW = 60.0
"""Length of the sliding windows of ``requests_per_minute`` and ``tokens_per_minute``, seconds."""

PENDING_TTL = 3600.0
"""How long an unsettled admission is remembered after its last admission or heartbeat, seconds.
Settling it later is a no-op for tokens and budgets."""

REFUND_TTL = 7 * 86400.0
"""How long the marker of an admission the reconciler refunded (with its lease's description),
or of one charged once after a rebuild, is kept, seconds: a usage row spooled on a replica's
disk is charged when it is replayed within this time (`Limiter.charge_replayed`)."""

CONCURRENCY_RETRY_HINT = 1.0
"""Upper bound of ``retry_after`` for a concurrency refusal: any in-flight request may finish at
any moment, so the expiry of the oldest lease is only a worst case."""

BUDGET_GRACE = 86400.0
"""Day and month counters are kept this long after their period ends (late settlements)."""

RATE_LIMIT = "rate_limit_exceeded"
INSUFFICIENT_QUOTA = "insufficient_quota"

# Indices of the Quota fields, as used by the Lua script and the in-process backend.
RPM, TPM, CONC, DAY, MONTH = range(5)
if QUOTA_FIELDS != (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "daily_token_budget",
    "monthly_token_budget",
):
    raise ImportError("lockgate.tenancy.limiter: the Quota fields changed; update RPM..MONTH and limiter.lua")

_SCOPE_KEY = re.compile(r"^[A-Za-z0-9:_-]{1,200}$")
_MAX_REQUEST_ID = 256


@dataclass(frozen=True)
class LimitScope:
    """One set of limits a request is counted against, e.g. a tenant or an API key.

    ``key`` names the counters (``"tenant:ten_123"``, ``"key:key_456"``): 1 to 200 characters
    of ``[A-Za-z0-9:_-]``. ``tag`` (same characters) is the group the counters belong to, the
    Redis hash tag of their keys: ``None`` (the default) is the scope's own key. On Redis
    Cluster the limited scopes of one request must share a tag, since one script touches all
    their keys: the gateway puts an API key's scope in its tenant's tag
    (``LimitScope("key:K", q, tag="tenant:T")``). Counters are those of ``(tag, key)`` on
    every backend: the same key under another tag counts apart.
    """

    key: str
    quota: Quota
    tag: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not _SCOPE_KEY.match(self.key):
            raise Invalid("scope.key",
                          f"must be 1-200 characters of [A-Za-z0-9:_-], got {self.key!r}")
        if not isinstance(self.quota, Quota):
            raise Invalid("scope.quota", f"must be a Quota, got {type(self.quota).__name__}")
        if self.tag is not None and (not isinstance(self.tag, str) or not _SCOPE_KEY.match(self.tag)):
            raise Invalid("scope.tag",
                          f"must be None or 1-200 characters of [A-Za-z0-9:_-], got {self.tag!r}")

    @property
    def group(self) -> str:
        """The tag the scope's counters belong to: ``tag``, or the key itself."""
        return self.key if self.tag is None else self.tag

    @property
    def counters(self) -> str:
        """The name of the scope's counters: ``key`` in its own group, else ``tag/key``."""
        return self.key if self.group == self.key else f"{self.group}/{self.key}"


@dataclass(frozen=True)
class Lease:
    """What an admitted request holds until it is settled.

    ``day`` and ``month`` are the UTC periods the reservation was charged to; settlement
    adjusts those counters whatever the date is by then.
    """

    request_id: str
    scopes: tuple[LimitScope, ...]
    reserved_tokens: int
    day: str
    month: str
    acquired_at: float
    epoch: str = ""     # the Redis tag's epoch it was admitted in ("" in-process)


@dataclass(frozen=True)
class ReplayedRow:
    """A usage row replayed from a replica's spool, as `Limiter.charge_replayed` needs it."""

    request_id: str
    tenant_id: str
    api_key_id: str
    tokens: int             # what the budgets count (prompt + completion unless priced)
    created_at: float       # epoch seconds


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


class ScopeUsage(TypedDict):
    """What a scope's counters hold now (`Limiter.live_usage`): its minute windows, its live
    concurrency leases and its current UTC day's and month's budget counters. A counter a
    scope does not keep (its limit unset) reads 0."""

    requests_in_window: int
    tokens_in_window: int
    concurrent: int
    day_tokens: int
    month_tokens: int
    requests_reset_at: float | None   # epoch s: the oldest request leaves the window (None: empty)
    tokens_reset_at: float | None     # epoch s: the oldest entry holding tokens leaves it


class Limiter(ABC):
    """Checks and applies the limits of several scopes atomically (see `tenancy.limiter`)."""

    lease_ttl: float

    @abstractmethod
    async def acquire(self, request_id: str, scopes: Sequence[LimitScope],
                      tokens: int) -> Decision:
        """Admit ``request_id`` reserving ``tokens`` in every scope, or refuse and change nothing.

        Raises Invalid (a ValueError) for a bad argument, or a ``request_id`` that was already
        admitted (unsettled, or still in a sliding window): request ids must be unique.
        """

    @abstractmethod
    async def reserve(self, lease: Lease, tokens: int) -> Decision:
        """The second step of a two-step admission: add ``tokens`` to an unsettled admission's
        reservation (its tokens-per-minute entry while in the window, its day and month budgets
        of the lease's periods) if every tokens-per-minute and budget limit of every scope has
        room for them; otherwise refuse and change nothing (the admission itself stays, to be
        settled or cancelled). An allowed decision's lease replaces ``lease`` (its
        ``reserved_tokens`` grown by ``tokens``).

        The gateway admits with ``acquire(..., tokens=0)`` before it reads a request's body
        (counting the request and taking its concurrency lease), then reserves the tokens
        once the prompt is tokenized. Raises Invalid when the admission is no longer
        unsettled (settled, cancelled, or abandoned by the reconciler)."""

    @abstractmethod
    async def settle(self, lease: Lease, used_tokens: int, budget_tokens: int | None = None) -> None:
        """End the request: release its concurrency lease, rewrite its tokens-per-minute entry
        (if still in the window) to ``used_tokens`` and its budget counters to
        ``budget_tokens`` (``used_tokens`` when None: a plan may price cached prompt tokens
        below others on its budgets, never on its rate). Idempotent, and a no-op after
        `cancel`."""

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
    async def live_usage(self, scope: LimitScope) -> ScopeUsage:
        """What ``scope``'s counters hold now (read-only; on Redis one call bounded by its
        timeout): its windows, leases and current UTC day's and month's budgets, and when
        the windows next drop an entry (`ScopeUsage`)."""

    async def usage(self, scope: LimitScope) -> dict[str, int]:
        """Current counts of ``scope``: ``requests_in_window``, ``tokens_in_window``,
        ``concurrent``, ``day_tokens`` and ``month_tokens`` (current UTC day and month)."""
        u = await self.live_usage(scope)
        return {"requests_in_window": u["requests_in_window"],
                "tokens_in_window": u["tokens_in_window"], "concurrent": u["concurrent"],
                "day_tokens": u["day_tokens"], "month_tokens": u["month_tokens"]}

    async def expired(self, limit: int = 100) -> list[Lease]:
        """Unsettled admissions whose lease ran out (no heartbeat for ``lease_ttl``): their
        process died, or lost the backend for longer than that. For the reconciler, which
        settles each to its usage row (`settle`), or `abandon`s it when there is none. An
        in-process limiter dies with its process, so it has none."""
        return []

    async def abandon(self, lease: Lease) -> bool:
        """Refund the reservation of an admission found by `expired` with no usage row, if
        its lease is still expired (False when a heartbeat renewed it meanwhile, or it was
        settled). Its request keeps its requests-per-minute count; a late `settle` of it
        (the process was alive after all) charges the used tokens in full, a late `cancel`
        takes it out of the windows."""
        return False

    async def charge_replayed(self, rows: Sequence[ReplayedRow]) -> int:
        """Charge the budgets for usage rows replayed from a spool whose tokens no counter
        holds: the reconciler refunded their admission (`abandon`) before the row reached the
        database, or Redis lost the settlement and the rebuild ran before the row arrived.
        Each at most once (whoever replays it, however often); the number charged. The
        in-process backend never refunds and has no epoch to lose: 0."""
        return 0

    async def check(self) -> str:
        """The backend's health for a readiness probe, answered within the backend's own
        timeout: "ok", "degraded" (limits enforced, but not as configured: per replica), or
        "unavailable" (new requests cannot be admitted)."""
        return "ok"

    @abstractmethod
    async def close(self) -> None:
        """Release the backend's resources."""


# -- argument checks shared by the backends ----------------------------------------------------


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise Invalid("request_id", f"must be a non-empty string, got {request_id!r}")
    if len(request_id) > _MAX_REQUEST_ID:
        raise Invalid("request_id", f"at most {_MAX_REQUEST_ID} characters, "
                                    f"got {len(request_id)}")
    return request_id


def check_scopes(scopes: Sequence[LimitScope]) -> tuple[LimitScope, ...]:
    if isinstance(scopes, (str, bytes)) or not isinstance(scopes, Sequence):
        raise Invalid("scopes", f"must be a sequence of LimitScope, got {type(scopes).__name__}")
    seen: set[str] = set()
    for s in scopes:
        if not isinstance(s, LimitScope):
            raise Invalid("scopes", f"every item must be a LimitScope, got {type(s).__name__}")
        if s.key in seen:
            raise Invalid("scopes", f"scope key {s.key!r} appears twice")
        seen.add(s.key)
    return tuple(scopes)


def check_scope(scope: object) -> LimitScope:
    if not isinstance(scope, LimitScope):
        raise Invalid("scope", f"must be a LimitScope, got {type(scope).__name__}")
    return scope


def check_lease(lease: object) -> Lease:
    if not isinstance(lease, Lease):
        raise Invalid("lease", f"must be a Lease, got {type(lease).__name__}")
    return lease


def check_lease_ttl(lease_ttl: object) -> float:
    if not isinstance(lease_ttl, (int, float)) or isinstance(lease_ttl, bool) or lease_ttl <= 0:
        raise Invalid("lease_ttl", f"must be a positive number of seconds, got {lease_ttl!r}")
    return float(lease_ttl)


def duplicate(request_id: str) -> Invalid:
    """The error of an ``acquire`` whose request id was already admitted."""
    return Invalid("request_id", f"{request_id!r} was already admitted (unsettled, or still in "
                                 f"the {WINDOW:g} s window); request ids must be unique")


@lru_cache(maxsize=4096)
def limits_of(q: Quota) -> tuple[int, int, int, int, int]:
    """The quota's limits in field order, -1 for unlimited (the Lua script's encoding).
    Cached: a quota is frozen, and the same few go with every request of a tenant."""
    values = [getattr(q, f) for f in QUOTA_FIELDS]
    rpm, tpm, conc, day, month = (-1 if v is None else v for v in values)
    return rpm, tpm, conc, day, month


def describe_lease(limited: Sequence[LimitScope], day: str, month: str, acquired_at: float) -> str:
    """A lease's scopes and periods as one string (stored with a Redis admission for the
    reconciler): ``day|month|acquired_at|key,rpm,tpm,conc,day,month;...``, the key written
    ``key@tag`` for a scope with a tag (``@`` is not a key's character). Redis appends
    ``|epoch``, the tag's epoch the admission was made in."""
    scopes = ";".join(",".join([s.key if s.tag is None else f"{s.key}@{s.tag}",
                                *(str(v) for v in limits_of(s.quota))]) for s in limited)
    return f"{day}|{month}|{acquired_at!r}|{scopes}"


def parse_lease(request_id: str, info: str, reserved: int) -> Lease:
    """The `Lease` that `describe_lease` described (Invalid if ``info`` is not one)."""
    try:
        day, month, acquired, scopes, *epoch = info.split("|")
        if len(epoch) > 1:
            raise ValueError("too many parts")
        parsed = []
        for part in scopes.split(";") if scopes else []:
            name, *lims = part.split(",")
            key, _, tag = name.partition("@")
            values = [None if int(v) < 0 else int(v) for v in lims]
            parsed.append(LimitScope(key, Quota(*values), tag or None))
        return Lease(request_id=request_id, scopes=tuple(parsed), reserved_tokens=reserved,
                     day=day, month=month, acquired_at=float(acquired),
                     epoch=epoch[0] if epoch else "")
    except (ValueError, TypeError) as exc:
        raise Invalid("info", f"not a lease description: {info!r} ({exc})") from None
