"""Lockgate's rate and quota limiter: one meaning, two backends (in-process and Redis).

Every request is checked against a list of limit scopes (`LimitScope`: typically the tenant's
quota and the API key's quota). All limits of all scopes are checked and applied in one atomic
step: if any of them refuses, nothing changes anywhere. The limits (see `tenancy.quota.Quota`):

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

Admission may come in two steps: `Limiter.acquire` with 0 tokens counts the request (its
requests-per-minute entry and concurrency lease) before anything is known of its size, and
`Limiter.reserve` adds its tokens once known, or refuses and changes nothing (the gateway then
settles the admission to 0: the request keeps its rate count, as OpenAI counts failed
requests). `acquire` itself still changes nothing when it refuses.

A process that dies leaves its admissions unsettled. Their concurrency leases expire by
themselves; `Limiter.expired` lists them (Redis keeps an index of unsettled admissions, renewed
by heartbeats) so that a reconciler settles each to its usage row, or `abandon`s it (its
reservation refunded; a late settle by a process that was alive after all charges what it
used in full).

A settlement or cancellation whose marker is gone (already settled or cancelled, or abandoned
for longer than `PENDING_TTL` without heartbeats) only drops the concurrency lease; the
reservation then stays charged to the budgets, the conservative choice. A refunded admission's
usage row that reaches the database later (replayed from a replica's spool) is charged then,
once (`Limiter.charge_replayed`; the marker of a refund is kept `REFUND_TTL`, 7 days).

Losing Redis (a restart without persistence, a Cluster node back without its slots): the
usage rows are the truth, the budgets their running sum, and the budgets are rebuilt from them
(`redis_epoch`, `rebuild`). Each hash tag has an epoch; a tag without one answers every
admission and settlement with 'rebuild', and the limiter sets the tag's day and month
counters to the sums of its rows (prompt + completion tokens by tenant and key, UTC day and
month of `created_at`), sets the epoch and tries once more; the database unreachable, the call
raises `LimiterUnavailable` (the gateway's 503, or the fallback if `open`): a lost budget is
never read as zero. What is not rebuilt, and the rule for it:

- requests-per-minute and tokens-per-minute windows start empty: for up to one window after
  the loss a tenant may be admitted up to twice its per-minute limits;
- concurrency leases start empty: requests in flight during the loss hold no lease, so for as
  long as they run a tenant may have up to twice its concurrency;
- reservations of requests in flight during the loss are in no counter (the rebuild counts
  rows, not reservations): until they end the budget under-reserves them. Each *settles after
  the rebuild*: an admission from before the current epoch (`Lease.epoch`) is stale, and its
  settlement charges its used tokens unless the rebuild already counted its row (the rebuild
  records the highest row id it counted, under a lock that orders it with the row inserts, so
  "counted" is "its row id is at or below it"); its marker 's' makes that once, whoever
  settles it and however often. So the order of a request's row and its settlement does not
  matter: row first, the rebuild counted it or the settlement charges it; settlement first,
  the row comes later and is not counted. A stale reservation or cancellation charges
  nothing; a stale admission the reconciler abandons is refunded nothing (it held nothing) and
  its row, if replayed later, is charged as a refunded one's.
- A spooled row replayed after the rebuild whose settlement was lost with Redis (its request
  ended before the epoch, its marker is gone) is charged on replay unless the rebuild counted
  it; it is told apart by its `created_at` against the epoch's time (the gateway's clock
  against Redis's: rows within the clocks' skew of a rebuild may be misjudged).

The epoch key has no expiry, so that only losing the tag's keys loses it; run Redis with an
eviction policy that evicts only keys with a TTL (`noeviction` or `volatile-*`). Deleting a
tag's epoch forces its rebuild. A Redis restored from an older snapshot keeps its epoch and is
not detected. The in-process limiter has no epoch to lose: it dies with its process.

Why this is written here rather than taken from the ``limits`` library: ``limits`` checks one
rate limit per call (``hit``/``test`` of one item), so checking the tenant's and the key's
quotas means several round trips with a window between them in which other replicas get in,
and a refusal by the second limit cannot undo the hit already taken by the first. It has no
notion of a reservation that is later settled to a different amount (tokens: prompt +
max_tokens reserved up front, rewritten to the tokens used), of concurrency leases that expire
without heartbeats, or of token budgets per calendar period adjusted after the fact. Lockgate
needs all of these decided together: one Lua script per admission (and one per settlement or
cancellation) that reads and writes every limit of every scope atomically, on Redis's own clock.

The package:

- `base`: the interface `Limiter`, the values (`LimitScope`, `Lease`, `Decision`), constants
  and argument checks; `periods` (UTC days and months) and `decision` (a backend's findings
  -> `Decision`) are shared by both backends.
- `memory`: `InProcessLimiter`, plain dicts and deques for a single gateway process. Each
  operation runs without an ``await`` inside its critical section (and under a
  `threading.Lock`, so calls from several threads or event loops are safe too). Its clock is
  injectable for tests.
- `redis`: `RedisLimiter`, shared by all replicas: one ``EVALSHA`` of `limiter.lua` per
  acquire / settle / cancel, and per tag for heartbeat (its docstring gives the key layout,
  `keys` the key names), over the pipelined connection of `redis_pipe` (every wait bounded
  by a timeout, 250 ms by default), or over redis-py's Cluster or Sentinel client
  (`redis_conn`: ``redis+cluster://`` and ``redis+sentinel://`` URLs). All the keys of one
  request share one hash tag (the group of its first limited scope, `LimitScope.tag`), so
  the script runs on Redis Cluster, on the node that owns the slot.
- `failover`: `FailoverLimiter`, the Redis limiter while Redis fails: closed (refuse) or open
  (the in-process limiter per replica), settlements queued until Redis answers again.
- `redis_epoch`: the Redis limiter's epochs (above); `rebuild`: `BudgetRebuilder`, a tag's
  day and month totals from the usage rows, and whether a rebuild counted a request's row.

Errors: a bad argument is `tenancy.errors.Invalid` (a ValueError naming the field); a Redis
that cannot be reached, or does not answer within the timeout, is
`tenancy.errors.LimiterUnavailable`.
"""

from __future__ import annotations

from typing import Any

from lockgate.tenancy.limiter.base import (
    CONCURRENCY_RETRY_HINT,
    PENDING_TTL,
    WINDOW,
    Decision,
    Lease,
    Limiter,
    LimitScope,
)
from lockgate.tenancy.limiter.failover import FailoverLimiter
from lockgate.tenancy.limiter.in_process import InProcessLimiter
from lockgate.tenancy.limiter.redis import RedisLimiter

__all__ = [
    "CONCURRENCY_RETRY_HINT",
    "PENDING_TTL",
    "WINDOW",
    "Decision",
    "FailoverLimiter",
    "InProcessLimiter",
    "Lease",
    "LimitScope",
    "Limiter",
    "RedisLimiter",
    "make_limiter",
]


def make_limiter(redis_url: str | None, **kw: Any) -> Limiter:
    """A `RedisLimiter` on ``redis_url`` (one node, Cluster or Sentinel: `redis_conn`), or an
    `InProcessLimiter` when it is None or empty.

    ``kw`` goes to the constructor (``lease_ttl``; ``prefix`` for Redis, ignored in-process;
    ``clock`` in-process only).
    """
    if redis_url:
        return RedisLimiter(redis_url, **kw)
    kw.pop("prefix", None)
    return InProcessLimiter(**kw)
