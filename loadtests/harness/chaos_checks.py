"""The chaos run's checks, from the services' own state: the usage rows in PostgreSQL against
the clients' attempts, the limiter's leases and day counters in Redis.

**Usage rows** (`check_rows`). Every attempt carried an `x-request-id` of its own, stored on
its row as `client_request_id`. An attempt the client saw succeed (200 JSON, or a stream to
its route's last event) has exactly one row, status "ok", with the tokens the client was
told; a stream the client left on purpose exactly one too (any status), unless its replica
was killed within `LEFT_GRACE_S` of it (then at most one); any other attempt at most one; a
row no attempt's id names is invented. `rows_by_route` judges each route's attempts alone.

**Killed streams** (`killed_streams`): per kill and route, the streams under way on the
killed replica (content read): each at most one row, and its admission settled (its lease
among the dead process's, then gone from the pending index: settled to its row or refunded
by a reconciler; or settled by its own process, with its row, just before the kill).

**Leases** (`LeaseWatch`, `check_leases`). A lease is a member of a scope's sorted set
``{prefix}{scope}:lease`` whose score is its expiry on Redis's clock (µs); a heartbeat sets it
to now + ttl, and the limiter stops counting a member once Redis's clock passes its score
(acquire drops members with score <= now before counting), whether or not anything removes
it. Each replica uses keys of its own (one per tenant, with a concurrency limit), so a
replica's leases are the members of its keys' lease sets. At a kill the driver reaps the
process, then reads Redis's TIME (T_k) and those sets: their members are the dead process's
unsettled admissions (nothing else writes to those sets while the replica is down). A dead
process heartbeats no more, so each such lease's score, its last heartbeat + ttl, is at most
T_k + ttl: the slot is back by then, whatever the reconciler does. (A kill while Redis is
hung is read once Redis answers again, and T_k is then: a heartbeat the process sent before
it died, still unread in Redis's socket, runs only then, so its lease lives ttl from there.) The check asserts every
score ever seen for such a member (sampled through the run, at the kill, and at the end) is
<= T_k + ttl + one heartbeat (the promise), reports the largest score - T_k, and, once
Redis's clock is past the last kill + ttl + heartbeat, that no scope holds a live lease
(ZCOUNT of scores > now is 0 everywhere: every request of the run has ended by then).
It also reports when each kill's admissions left the pending index (a
reconciler settled them to their rows or refunded them: their budgets corrected; one index
per tenant, ``{prefix}{tenant:ID}:pending``), as first
seen by the sampler, on Redis's clock.

**Budgets** (`budget_gaps`): each tenant's day counters ``{prefix}{tenant:ID}:day:*`` against
the sum of prompt + completion tokens of its rows. A killed replica's admissions stay
reserved on the counter until a reconciler settles them to their rows or refunds them, so
this converges only with one running; the caller polls.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lockgate.loadtests.harness.chaos_client import OUTCOMES, Attempt

_US = 1_000_000
LEFT_GRACE_S = 2.0     # a stream left this long before its replica's kill may have no row


def lease_key(prefix: str, scope: str, tag: str | None = None) -> str:
    """A scope's lease set (tenancy/limiter/keys.py): ``P{tag}scope:lease``; a scope that is its
    own tag (a tenant) ``P{scope}:lease``. The gateway tags an API key's scope by its tenant."""
    from lockgate.tenancy.limiter import LimitScope
    from lockgate.tenancy.limiter.redis_keys import scope_key
    from lockgate.tenancy.quota import Quota

    return scope_key(prefix, LimitScope(scope, Quota(), tag=tag), "lease")


@dataclass(slots=True)
class KillSnapshot:
    replica: int
    redis_us: int                          # Redis's TIME once the process was reaped
    leases: dict[str, int]                 # its unsettled admissions: member -> score (µs)
    reserved_tokens: int = 0               # their reservations on the budgets, at the kill


class LeaseWatch:
    """Samples every lease set of the run (each `interval` s), keeping the highest score seen
    per member; `at_kill` attributes a killed replica's members to its kill."""

    def __init__(self, redis_url: str, prefix: str, tenant_keys: Sequence[str],
                 replica_keys: Sequence[Sequence[str]], tenant_ids: Sequence[str] = ()) -> None:
        import redis.asyncio as aioredis

        self.client = aioredis.Redis.from_url(redis_url, socket_timeout=0.5,
                                              socket_connect_timeout=0.5)
        self.tenant_keys = list(tenant_keys)
        self.replica_keys = [list(k) for k in replica_keys]
        self.all_keys = self.tenant_keys + [k for keys in self.replica_keys for k in keys]
        self.max_score: dict[str, int] = {}
        self.kills: list[KillSnapshot] = []
        from lockgate.tenancy.limiter.redis_keys import pending_keys

        # the pending index is per tenant (the request's hash tag)
        index = [pending_keys(prefix, f"tenant:{t}") for t in tenant_ids]
        self.pending_keys = [k[0] for k in index]
        self.reserved_keys = [k[2] for k in index]
        self.reconciled_at: dict[str, int] = {}   # killed admission -> first seen unpending (µs)
        self.samples = 0
        self.failed_samples = 0          # Redis hung or gone: nothing read that time

    async def _read(self, keys: Sequence[str]) -> dict[str, dict[str, int]]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.zrange(k, 0, -1, withscores=True)
        replies = await pipe.execute()
        out: dict[str, dict[str, int]] = {}
        for k, members in zip(keys, replies, strict=True):
            out[k] = {m.decode(): int(s) for m, s in members}
            for m, s in out[k].items():
                if s > self.max_score.get(m, -1):
                    self.max_score[m] = s
        return out

    async def sample(self) -> None:
        try:
            await self._read(self.all_keys)
            await self._read_pending()
            self.samples += 1
        except Exception:  # noqa: BLE001 - a hung or unreachable Redis: try again next time
            self.failed_samples += 1

    async def _read_pending(self) -> None:
        """When (Redis's clock) each killed admission was first seen gone from the pending
        index: settled to its row or refunded by a reconciler."""
        pipe = self.client.pipeline(transaction=False)
        pipe.time()
        for k in self.pending_keys:
            pipe.zrange(k, 0, -1)
        (sec, usec), *sets = await pipe.execute()
        now = int(sec) * _US + int(usec)
        pending = {m.decode() for members in sets for m in members}
        for k in self.kills:
            for m in k.leases:
                if m not in pending and m not in self.reconciled_at:
                    self.reconciled_at[m] = now

    async def run(self, stop: asyncio.Event, interval: float = 0.25) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def now_us(self) -> int:
        sec, usec = await self.client.time()
        return int(sec) * _US + int(usec)

    async def holds_lease(self, replica: int) -> bool:
        """Whether the replica's lease sets hold a member now (ignoring the errors of a
        hung Redis: False)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in self.replica_keys[replica]:
                pipe.zcard(k)
            return sum(await pipe.execute()) > 0
        except Exception:  # noqa: BLE001
            return False

    async def at_kill(self, replica: int) -> KillSnapshot:
        """Call once the killed process is reaped: its unsettled admissions, and T_k. (A kill
        while Redis was hung: once it answers again. Commands the dead process had sent and
        Redis had not read yet, a heartbeat, run when it does, so T_k is then.)"""
        now = await self.now_us()
        sets = await self._read(self.replica_keys[replica])
        earlier = {m for k in self.kills for m in k.leases}
        leases = {m: s for members in sets.values() for m, s in members.items() if m not in earlier}
        total = 0
        for k in self.reserved_keys if leases else []:
            total += sum(int(r or 0) for r in await self.client.hmget(k, list(leases)))
        snap = KillSnapshot(replica, now, leases, total)
        self.kills.append(snap)
        return snap

    async def live(self, now_us: int) -> dict[str, int]:
        """Per lease set, the members the limiter still counts (score > now)."""
        pipe = self.client.pipeline(transaction=False)
        for k in self.all_keys:
            pipe.zcount(k, f"({now_us}", "+inf")
        counts = await pipe.execute()
        return {k: int(c) for k, c in zip(self.all_keys, counts, strict=True) if int(c)}

    async def close(self) -> None:
        await self.client.aclose()


@dataclass(slots=True)
class LeaseReport:
    ttl_s: float
    heartbeat_s: float
    # per kill: replica, leases, live_at_kill, max_expiry_after_kill_s, over_bound,
    # reserved_tokens, unreconciled, reconciled_after_kill_s
    kills: list[dict[str, Any]]
    live_after_deadline: dict[str, int]    # lease set -> live members once past every kill's deadline
    checked_after_last_kill_s: float | None

    @property
    def ok(self) -> bool:
        return not self.live_after_deadline and all(k["over_bound"] == 0 for k in self.kills)


async def check_leases(watch: LeaseWatch, ttl_s: float, heartbeat_s: float) -> LeaseReport:
    """Wait until Redis's clock passes the last kill + ttl + heartbeat, then judge (see the
    module docstring)."""
    bound = round((ttl_s + heartbeat_s) * _US)
    last_kill = max((k.redis_us for k in watch.kills), default=None)
    now = await watch.now_us()
    if last_kill is not None:
        while now <= last_kill + bound:
            await asyncio.sleep(min(0.5, (last_kill + bound - now) / _US + 0.01))
            now = await watch.now_us()
    await watch.sample()             # the last scores of every member still there
    live = await watch.live(now)
    kills = []
    for k in watch.kills:
        scores = [max(s, watch.max_score.get(m, s)) for m, s in k.leases.items()]
        kills.append({
            "replica": k.replica, "leases": len(scores),
            "live_at_kill": sum(1 for s in scores if s > k.redis_us),
            "max_expiry_after_kill_s": (max(scores) - k.redis_us) / _US if scores else None,
            "over_bound": sum(1 for s in scores if s > k.redis_us + bound),
            "reserved_tokens": k.reserved_tokens,
            "unreconciled": sum(1 for m in k.leases if m not in watch.reconciled_at),
            "reconciled_after_kill_s": (
                max(watch.reconciled_at[m] for m in k.leases) - k.redis_us) / _US
            if k.leases and all(m in watch.reconciled_at for m in k.leases) else None,
        })
    return LeaseReport(ttl_s, heartbeat_s, kills, live,
                       (now - last_kill) / _US if last_kill is not None else None)


# -- usage rows ---------------------------------------------------------------------------------
@dataclass(slots=True)
class Row:
    client_request_id: str | None
    request_id: str
    tenant_id: str
    status: str
    prompt_tokens: int
    completion_tokens: int


async def fetch_rows(dsn: str) -> list[Row]:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        records = await conn.fetch(
            "SELECT client_request_id, request_id, tenant_id, status, prompt_tokens, "
            "completion_tokens FROM usage_records")
    finally:
        await conn.close()
    return [Row(*r) for r in records]


@dataclass(slots=True)
class RowsReport:
    rows: int
    ok_attempts: int
    lost: int = 0               # "ok" attempts with no row
    duplicated: int = 0         # attempts with more than one row
    invented: int = 0           # rows whose client id no attempt sent
    mismatched: int = 0         # "ok" attempts whose row is not "ok" or bills other tokens
    left_unwritten: int = 0     # left streams with no row, their replica killed just after
    # outcome -> attempts, those with a row, and the rows' statuses
    by_outcome: dict[str, dict[str, Any]] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.invented or self.mismatched)


def _killed_soon_after(a: Attempt, kills: Sequence[tuple[int, float]]) -> bool:
    return any(r == a.replica and a.ended <= t <= a.ended + LEFT_GRACE_S for r, t in kills)


def check_rows(attempts: Sequence[Attempt], rows: Sequence[Row],
               kills: Sequence[tuple[int, float]] = ()) -> RowsReport:
    """`kills`: (replica, time.time()) of each kill, for the streams left just before one."""
    by_id: dict[str | None, list[Row]] = defaultdict(list)
    for r in rows:
        by_id[r.client_request_id].append(r)
    report = RowsReport(len(rows), sum(1 for a in attempts if a.outcome == "ok"))
    outcomes = {o: {"attempts": 0, "with_row": 0, "row_statuses": Counter()} for o in OUTCOMES}

    def problem(what: str) -> None:
        if len(report.examples) < 10:
            report.examples.append(what)

    for a in attempts:
        found = by_id.pop(a.client_id, [])
        cat = outcomes[a.outcome]
        cat["attempts"] += 1
        cat["with_row"] += 1 if found else 0
        cat["row_statuses"].update(r.status for r in found)
        if len(found) > 1:
            report.duplicated += 1
            problem(f"{a.client_id} ({a.outcome}): {len(found)} rows")
        if a.outcome == "left" and not found:
            if _killed_soon_after(a, kills):
                report.left_unwritten += 1
            else:
                report.lost += 1
                problem(f"{a.client_id} (left, {a.route}, replica {a.replica}): no row")
        if a.outcome != "ok":
            continue
        if not found:
            report.lost += 1
            problem(f"{a.client_id} (ok, {a.route}, replica {a.replica}): no row")
        elif (found[0].status != "ok"
              or (a.usage is not None and a.usage != (found[0].prompt_tokens, found[0].completion_tokens))):
            report.mismatched += 1
            problem(f"{a.client_id}: told {a.usage}, row {found[0]}")
    for cid, extra in by_id.items():
        report.invented += len(extra)
        problem(f"row(s) of client id {cid!r} that no attempt sent: {len(extra)}")
    report.by_outcome = {o: {**c, "row_statuses": dict(c["row_statuses"])}
                         for o, c in outcomes.items() if c["attempts"]}
    return report


def rows_by_route(attempts: Sequence[Attempt], rows: Sequence[Row],
                  kills: Sequence[tuple[int, float]] = ()) -> dict[str, RowsReport]:
    """`check_rows` of each route's attempts against the rows their ids name (a row no
    attempt names is the whole run's `invented`)."""
    route_of = {a.client_id: a.route for a in attempts}
    out = {}
    for route in sorted({a.route for a in attempts}):
        mine = [a for a in attempts if a.route == route]
        out[route] = check_rows(mine, [r for r in rows if route_of.get(r.client_request_id) == route], kills)
    return out


def killed_streams(mid_stream: dict[str, list[str]], leases: dict[str, int], attempts: Sequence[Attempt],
                   rows: Sequence[Row], reconciled_at: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per route, of the streams under way at a kill (client ids): how many, how many the
    kill cut (the others ended just before it), how many held a lease of the dead process,
    how many are settled (see the module docstring), and the most rows any of them has."""
    by_id = {a.client_id: a for a in attempts}
    num_rows = Counter(r.client_request_id for r in rows)
    out = {}
    for route, ids in mid_stream.items():
        leased = settled = most = 0
        for cid in ids:
            sid = by_id[cid].server_id
            held = sid is not None and sid in leases
            leased += held
            settled += (sid in reconciled_at) if held else num_rows[cid] == 1
            most = max(most, num_rows[cid])
        out[route] = {"mid_stream": len(ids), "cut": sum(by_id[cid].outcome == "cut" for cid in ids),
                      "leased": leased, "settled": settled, "max_rows": most}
    return out


# -- budgets ------------------------------------------------------------------------------------
async def day_counter(client: Any, prefix: str, tenant_id: str) -> int:
    total = 0
    async for key in client.scan_iter(match=f"{prefix}{{tenant:{tenant_id}}}:day:*"):
        total += int(await client.get(key) or 0)
    return total


async def budget_gaps(client: Any, prefix: str, tenant_ids: Sequence[str],
                      rows: Sequence[Row]) -> dict[str, dict[str, int]]:
    """Per tenant: its day counters, its rows' tokens, and the difference."""
    billed: Counter[str] = Counter()
    for r in rows:
        billed[r.tenant_id] += r.prompt_tokens + r.completion_tokens
    out = {}
    for t in tenant_ids:
        counter = await day_counter(client, prefix, t)
        out[t] = {"counter": counter, "rows": billed[t], "gap": counter - billed[t]}
    return out
