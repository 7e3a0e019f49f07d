"""The chaos run's faults, and the driver that injects them one at a time under load:

- `kill`: SIGKILL of a replica once it holds a lease with requests in flight and a stream of
  every route (chat, Responses, Messages) under way on it, content already sent (the driver
  sends long streams of each route to it meanwhile, `chaos_client.long_streams`), then a
  restart on its port and data directory (so it replays what its dead process spooled);
- `redis_hang`: Redis stopped (SIGSTOP) for `redis_hang_s`, connections open;
- `db_stop`: PostgreSQL shut down (immediate) for `db_stop_s`;
- `redis_restart`: Redis killed (SIGKILL) and started again on its port, empty: every lease,
  reservation and day counter it held is gone;
- `overlap`: the database down and Redis hung together, then a replica killed while both
  are (its spool holding rows whose settlements it had queued in memory), then Redis back,
  the database back and the replica restarted on its data directory: `overlap_s` from the
  database stop to Redis's return.

`plan_faults` spreads them over the load, `drive_faults` injects each at its time or 1 s
after the previous one is over, whichever is later. A fault's `ended` is when the service it
took away is back (a kill: its replica restarted and ready; an overlap: Redis and the
database back, the replica restarting; `ready` says when it was).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lockgate.loadtests.harness.chaos_checks import LeaseWatch
from lockgate.loadtests.harness.chaos_client import Attempt, LoadState, long_streams
from lockgate.loadtests.harness.chaos_routes import ROUTES
from lockgate.loadtests.harness.own_redis import OwnRedis
from lockgate.loadtests.harness.pg import ThrowawayPostgres
from lockgate.loadtests.harness.replica import Replica

if TYPE_CHECKING:
    from lockgate.loadtests.chaos import ChaosConfig

KILLS = ("kill", "overlap")          # the faults that kill a replica
TARGETS = {"redis_hang": "redis", "db_stop": "postgres", "redis_restart": "redis"}


@dataclass
class Cluster:
    pg: ThrowawayPostgres
    redis: OwnRedis
    replicas: list[Replica]
    admin_key: str
    tenant_ids: list[str] = field(default_factory=list)
    keys: list[list[str]] = field(default_factory=list)       # [tenant][replica] the key
    key_ids: list[list[str]] = field(default_factory=list)    # [tenant][replica] its id


@dataclass(slots=True)
class Fault:
    kind: str                       # "kill", "redis_hang", "db_stop", "redis_restart", "overlap"
    target: str                     # "replica 0", "redis", "postgres" (overlap: the replica killed)
    planned: float                  # seconds after the load's start
    started: float = 0.0            # time.time()
    ended: float = 0.0              # a kill: the restarted replica ready; else the service(s) back
    ready: float = 0.0              # a kill, an overlap: the restarted replica ready
    in_flight: int = 0              # a kill: the client's attempts in flight on it at the kill
    killed_at: float = 0.0          # a kill, an overlap: time.time() of the SIGKILL
    leases_at_kill: int = 0         # a kill: the dead process's unsettled admissions
    # a kill: per route, the client ids of its streams under way on the replica (content read)
    mid_stream: dict[str, list[str]] = field(default_factory=dict)

    def recovery(self, attempts: list[Attempt]) -> float | None:
        """Seconds from the fault's end to the end of the first "ok" attempt that started
        after it (for a kill, on the restarted replica)."""
        replica = int(self.target.split()[1]) if self.kind == "kill" else None
        ends = [a.ended for a in attempts if a.outcome == "ok" and a.started >= self.ended
                and (replica is None or a.replica == replica)]
        return min(ends) - self.ended if ends else None


async def _loaded(replica: Replica, state: LoadState, watch: LeaseWatch, timeout: float,
                  long_one: bool = False, every_route: bool = False) -> None:
    """Until the replica holds a live lease with 2 attempts in flight, or `timeout` passed;
    `long_one`: one of them begun in the last 0.3 s and asking for the longest completion;
    `every_route`: a stream of each route under way on it, content read."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not state.done:
        if state.in_flight[replica.index] >= 2 and (not long_one or _long_one(replica, state)) \
                and (not every_route or len(mid_stream(replica.index, state, early=True)) == len(ROUTES)) \
                and await watch.holds_lease(replica.index):
            return
        await asyncio.sleep(0.005)


def mid_stream(replica: int, state: LoadState, early: bool = False) -> dict[str, list[str]]:
    """Per route, the streams under way on `replica` that have sent content; `early`: only
    those of 64 tokens or more not past half of them (not about to end as the kill comes)."""
    out: dict[str, list[str]] = {}
    for a in list(state.open.values()):
        if a.replica == replica and a.stream and a.deltas > 0 and a.status == 200 \
                and (not early or (a.max_tokens >= 64 and a.deltas <= a.max_tokens // 2)):
            out.setdefault(a.route, []).append(a.client_id)
    return out


def _long_one(replica: Replica, state: LoadState) -> bool:
    longest, now = max(a.max_tokens for a in state.attempts), time.time()
    return any(a.replica == replica.index and not a.ended and a.max_tokens == longest
               and now - a.started < 0.3 for a in state.attempts[-32:])


async def _kill(fault: Fault, replica: Replica, cfg: ChaosConfig, cluster: Cluster, state: LoadState,
                watch: LeaseWatch) -> None:
    """Kill it under load (once it holds a lease with 2 attempts in flight and a stream of each
    route under way, or 10 s passed), reap it, read its leases; restart it after
    `restart_pause_s`. Long streams of each route go to it until the kill, on the tenants
    with an ample budget (not the last, when it is the tight one)."""
    stop = asyncio.Event()
    tenants = range(max(1, len(cluster.keys) - (cfg.tight_budget_fraction > 0)))
    keys = [(t, cluster.keys[t][replica.index]) for t in tenants]
    streams = [asyncio.create_task(long_streams(
        route, replica.index, replica.url, keys[n:] + keys[:n], max(cfg.max_tokens), state.run_id,
        state, stop, cfg.client_timeout_s)) for n, route in enumerate(ROUTES)]
    try:
        await _loaded(replica, state, watch, 10.0, every_route=True)
        fault.in_flight = state.in_flight[replica.index]
        fault.mid_stream = mid_stream(replica.index, state)
        fault.started = fault.killed_at = time.time()
        stop.set()
        await asyncio.to_thread(replica.kill)
        snap = await watch.at_kill(replica.index)
        fault.leases_at_kill = len(snap.leases)
    finally:
        stop.set()
        await asyncio.gather(*streams, return_exceptions=True)
    await asyncio.sleep(cfg.restart_pause_s)
    await asyncio.to_thread(replica.start)
    fault.ended = fault.ready = time.time()


async def _overlap(fault: Fault, replica: Replica, cfg: ChaosConfig, cluster: Cluster,
                   state: LoadState, watch: LeaseWatch) -> None:
    """Once the replica is loaded (a long completion just begun): the database down and Redis
    hung at once, so that requests ending in the first half of `overlap_s`, past the limiter's
    timeout, spool their rows and queue their settlements in memory; then the replica killed
    (the rest cut); at `overlap_s` Redis back and the database back (`ended`), and the replica
    restarted on its data directory (`ready`), replaying its spool. Its leases are read once
    Redis answers again, and on Redis's clock then: what the dead process had sent and Redis
    had not read yet (a heartbeat) runs then."""
    await _loaded(replica, state, watch, 10.0, long_one=True)
    fault.started = time.time()
    stopping = asyncio.create_task(asyncio.to_thread(cluster.pg.stop))
    try:
        cluster.redis.pause()       # while the database shuts down: the requests under way end in both
        try:
            await stopping
            await asyncio.sleep(cfg.overlap_s / 2)
            fault.in_flight = state.in_flight[replica.index]
            fault.killed_at = time.time()
            await asyncio.to_thread(replica.kill)
            await asyncio.sleep(max(0.0, fault.started + cfg.overlap_s - time.time()))
        finally:
            cluster.redis.resume()
        snap = await watch.at_kill(replica.index)
        fault.leases_at_kill = len(snap.leases)
    finally:
        await asyncio.to_thread(cluster.pg.start)
    fault.ended = time.time()
    await asyncio.to_thread(replica.start)
    fault.ready = time.time()


async def _outage(fault: Fault, cfg: ChaosConfig, cluster: Cluster) -> None:
    """A Redis hang, a database stop or a Redis restart."""
    fault.started = time.time()
    if fault.kind == "redis_restart":
        await asyncio.to_thread(cluster.redis.restart)
    elif fault.kind == "redis_hang":
        cluster.redis.pause()
        try:
            await asyncio.sleep(cfg.redis_hang_s)
        finally:
            cluster.redis.resume()
    else:
        await asyncio.to_thread(cluster.pg.stop)
        try:
            await asyncio.sleep(cfg.db_stop_s)
        finally:
            await asyncio.to_thread(cluster.pg.start)
    fault.ended = time.time()


async def inject(fault: Fault, cfg: ChaosConfig, cluster: Cluster, state: LoadState,
                 watch: LeaseWatch) -> None:
    if fault.kind == "kill":
        await _kill(fault, cluster.replicas[int(fault.target.split()[1])], cfg, cluster, state, watch)
    elif fault.kind == "overlap":
        replica = cluster.replicas[int(fault.target.split()[1])]
        await _overlap(fault, replica, cfg, cluster, state, watch)
    else:
        await _outage(fault, cfg, cluster)


def plan_faults(cfg: ChaosConfig) -> list[Fault]:
    """The faults of `cfg.fault_kinds()`, evenly spaced between the warm-up and the tail; the
    replicas killed in turn."""
    kinds = cfg.fault_kinds()
    span = max(0.0, cfg.duration_s - cfg.warmup_s - cfg.tail_s)
    step = span / max(1, len(kinds))
    faults, kill_no = [], 0
    for i, kind in enumerate(kinds):
        target = TARGETS.get(kind, f"replica {kill_no % 2}")
        kill_no += kind in KILLS
        faults.append(Fault(kind, target, cfg.warmup_s + i * step))
    return faults


async def drive_faults(faults: list[Fault], cfg: ChaosConfig, cluster: Cluster, state: LoadState,
                       load_start: asyncio.Future, watch: LeaseWatch) -> None:
    """Each fault at its planned time, or 1 s after the previous one is over (its replica
    restarted) if that is later."""
    t0 = await load_start
    previous_end = 0.0
    for f in faults:
        await asyncio.sleep(max(0.0, t0 + f.planned - time.time(), previous_end + 1.0 - time.time()))
        await inject(f, cfg, cluster, state, watch)
        previous_end = time.time()
