"""The chaos run: two `lockgate serve` replicas on a PostgreSQL and a redis-server of the
run's own, tenants with a concurrency limit and a daily token budget, `num_requests` requests
with client-side ids on the three routes (chat completions, Responses, Messages: a third
each, streaming and not, some streams left by the client part way; `harness.chaos_routes`),
while a fault driver injects, one at a time (`harness.chaos_faults`): `kills` SIGKILLs of a
replica once a stream of each route is under way on it (restarted on its port and data
directory after `restart_pause_s`), a Redis hang (SIGSTOP ... SIGCONT) of `redis_hang_s`, a
database stop of `db_stop_s`, `redis_restarts` Redis restarts (killed, back empty) and an
overlap (database down, Redis hung, a replica killed, all cleared: `overlap_s`). Then the
checks of `harness.chaos_checks`: usage rows against attempts (the run's, and each route's),
the streams each kill cut (per route: at most one row, the admission settled or refunded),
the killed replicas' leases from the limiter's own state, budgets against rows; and the time
to recover from each fault.

    result = asyncio.run(run_chaos(ChaosConfig(num_requests=150, kills=1), work_dir))
    print("\\n".join(format_report(result)))

`lockgate bench chaos` runs the full size; `tests/e2e/test_chaos.py` a scaled-down one.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lockgate.loadtests.harness.chaos_checks import (
    LeaseReport,
    LeaseWatch,
    RowsReport,
    budget_gaps,
    check_leases,
    check_rows,
    fetch_rows,
    killed_streams,
    lease_key,
    rows_by_route,
)
from lockgate.loadtests.harness.chaos_client import Attempt, LoadPlan, LoadState, run_load
from lockgate.loadtests.harness.chaos_faults import KILLS, Cluster, Fault, drive_faults, plan_faults
from lockgate.loadtests.harness.chaos_routes import ROUTES
from lockgate.loadtests.harness.own_redis import OwnRedis
from lockgate.loadtests.harness.pg import ThrowawayPostgres, throwaway_postgres
from lockgate.loadtests.harness.replica import Replica, serve_env

ENGINE_KWARGS = {"kv_cache_memory": 32 << 20, "max_num_seqs": 64}
PREFIX = "chaos:"


@dataclass(slots=True)
class ChaosConfig:
    num_requests: int = 1000
    kills: int = 3
    redis_hang_s: float = 5.0
    db_stop_s: float = 5.0
    redis_restarts: int = 1          # Redis killed and started again empty, mid-run
    overlap_s: float = 6.0           # database down, Redis hung, a replica killed; 0: none
    duration_s: float = 120.0        # requests are paced at num_requests / duration_s, and go on
                                     # at that pace until every fault is over and tail_s has passed
    concurrency: int = 16            # client requests in flight, at most
    lease_ttl_s: float = 6.0         # the replicas' LOCKGATE_LEASE_TTL_S (heartbeat: a third)
    tenants: int = 3
    tenant_concurrency: int = 4      # each tenant's max_concurrent_requests
    tight_budget_fraction: float = 0.6   # the last tenant's daily budget, of its expected use
    max_tokens: tuple[int, ...] = (16, 64, 128, 256)   # long enough for a kill to find requests
    stream_fraction: float = 0.5
    leave_fraction: float = 0.1      # of streams, left by the client after 2 content events
    max_attempts: int = 6
    client_timeout_s: float = 15.0
    restart_pause_s: float = 0.5
    warmup_s: float = 3.0            # load before the first fault
    tail_s: float = 5.0              # load after the last fault, as planned
    key_cache_ttl_s: float | None = None   # None: the gateway's default
    seed: int = 0

    @property
    def heartbeat_s(self) -> float:
        """The gateway's heartbeat interval for this ttl (gateway/app.py `heartbeat`)."""
        return max(0.5, self.lease_ttl_s / 3)

    def fault_kinds(self) -> list[str]:
        """Kills interleaved with the other faults (harness/chaos_faults.py): the Redis hang,
        the database stop, the Redis restarts, the overlap."""
        others = [k for k, n in (("redis_hang", self.redis_hang_s > 0), ("db_stop", self.db_stop_s > 0),
                                 ("redis_restart", self.redis_restarts), ("overlap", self.overlap_s > 0))
                  for _ in range(int(n))]
        kinds: list[str] = []
        for i in range(max(self.kills, len(others))):
            if i < self.kills:
                kinds.append("kill")
            if i < len(others):
                kinds.append(others[i])
        return kinds


@dataclass
class ChaosResult:
    config: ChaosConfig
    started: float
    load_s: float
    requests: int
    attempts: list[Attempt]
    faults: list[Fault]
    rows: RowsReport
    leases: LeaseReport
    budgets: dict[str, dict[str, int]]      # tenant id -> counter, rows, gap (last seen)
    budgets_converged_s: float | None       # after the load, when every gap was 0; None: never
    lease_samples: tuple[int, int]          # sampled, failed (Redis hung)
    notes: list[str] = field(default_factory=list)
    by_route: dict[str, RowsReport] = field(default_factory=dict)
    # per plain kill: route -> its streams cut mid-way (chaos_checks.killed_streams)
    killed: list[dict[str, dict[str, int]]] = field(default_factory=list)

    @property
    def killed_ok(self) -> bool:
        """Every plain kill cut a stream of every route; each stream under way at it at most
        one row and its admission settled or refunded."""
        return all(set(k) == set(ROUTES) and all(c["cut"] >= 1 and c["max_rows"] <= 1
                                                  and c["settled"] == c["mid_stream"] for c in k.values())
                   for k in self.killed)

    @property
    def requests_ok(self) -> int:
        return len({a.request for a in self.attempts if a.outcome == "ok"})

    @property
    def budgets_ok(self) -> bool:
        return all(b["gap"] == 0 for b in self.budgets.values())

    @property
    def passed(self) -> bool:
        """Rows lost, invented, duplicated or mismatched: none; the killed replicas' leases
        released within ttl + heartbeat; budgets equal to the rows."""
        return (self.rows.ok and all(r.ok for r in self.by_route.values()) and self.killed_ok
                and self.leases.ok and self.budgets_ok)

    def recoveries(self) -> list[float | None]:
        return [f.recovery(self.attempts) for f in self.faults]

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": asdict(self.config), "load_s": self.load_s, "requests": self.requests,
            "requests_ok": self.requests_ok, "attempts": len(self.attempts),
            "faults": [{**asdict(f), "started": f.started - self.started,
                        "ended": f.ended - self.started, "recover_s": r,
                        "ready": f.ready - self.started if f.ready else None}
                       for f, r in zip(self.faults, self.recoveries(), strict=True)],
            "rows": asdict(self.rows), "leases": {**asdict(self.leases), "ok": self.leases.ok},
            "budgets": self.budgets, "budgets_ok": self.budgets_ok,
            "budgets_converged_s": self.budgets_converged_s, "passed": self.passed,
            "notes": self.notes, "by_route": {k: asdict(v) for k, v in self.by_route.items()},
            "killed": self.killed, "killed_ok": self.killed_ok,
        }


# -- the services and the tenants ---------------------------------------------------------------
def _replicas(cfg: ChaosConfig, work: Path, pg: ThrowawayPostgres, redis: OwnRedis,
              admin_key: str) -> list[Replica]:
    from lockgate.engine.demo_model import write_demo_model

    model = work / "model"
    if not model.exists():
        write_demo_model(model, family="llama", size="tiny", seed=0)
    extra = {"LOCKGATE_LEASE_TTL_S": str(cfg.lease_ttl_s), "LOCKGATE_DATABASE_TIMEOUT_S": "2",
             "LOCKGATE_USAGE_REPLAY_INTERVAL_S": "0.5", "LOCKGATE_REQUEST_TIMEOUT_S": "60"}
    if cfg.key_cache_ttl_s is not None:
        extra["LOCKGATE_KEY_CACHE_TTL_S"] = str(cfg.key_cache_ttl_s)
    env = serve_env(database_url=pg.url, redis_url=redis.url, redis_prefix=PREFIX,
                    pepper=secrets.token_hex(32), admin_key=admin_key,
                    engine_kwargs=ENGINE_KWARGS, extra=extra)
    return [Replica(i, work / f"replica-{i}", env, {"tiny": str(model)}) for i in range(2)]


def _make_tenants(cfg: ChaosConfig, cluster: Cluster) -> None:
    """`cfg.tenants` tenants, each with a key per replica (a concurrency limit on each key, so
    each replica's leases are a set of their own; far above the tenant's, so it never refuses)."""
    per_tenant = cfg.num_requests / cfg.tenants
    expected = per_tenant * (24 + sum(cfg.max_tokens) / len(cfg.max_tokens))
    with httpx.Client(base_url=cluster.replicas[0].url + "/admin/v1", timeout=30,
                      headers={"Authorization": f"Bearer {cluster.admin_key}"}) as admin:
        for t in range(cfg.tenants):
            tight = t == cfg.tenants - 1 and cfg.tight_budget_fraction > 0
            budget = int(expected * cfg.tight_budget_fraction) if tight else 1_000_000_000
            quota = {"max_concurrent_requests": cfg.tenant_concurrency, "daily_token_budget": budget}
            r = admin.post("/tenants", json={"name": f"chaos-{t}", "quota": quota})
            r.raise_for_status()
            tid = r.json()["id"]
            keys, ids = [], []
            for rep in cluster.replicas:
                k = admin.post(f"/tenants/{tid}/keys", json={
                    "name": f"replica-{rep.index}", "quota": {"max_concurrent_requests": 100_000}})
                k.raise_for_status()
                keys.append(k.json()["key"])
                ids.append(k.json()["id"])
            cluster.tenant_ids.append(tid)
            cluster.keys.append(keys)
            cluster.key_ids.append(ids)


# -- after the load -----------------------------------------------------------------------------
async def _settled(cluster: Cluster, timeout: float = 60.0) -> None:
    """Wait until every replica reads the database and holds no spooled usage row."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            try:
                states = [(await client.get(r.url + "/ready")).json() for r in cluster.replicas]
                if all(s.get("database") and s.get("usage_spooled") == 0 for s in states):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(0.25)
    raise RuntimeError(f"the replicas' spooled usage did not drain within {timeout:.0f} s")


async def _budgets(cfg: ChaosConfig, cluster: Cluster, watch: LeaseWatch, rows_dsn: str,
                   ) -> tuple[dict[str, dict[str, int]], float | None, list]:
    """Poll the budgets against the rows for up to 2 x ttl (+ a heartbeat): the reconciler's
    time to settle or refund the killed replicas' admissions."""
    t0 = time.monotonic()
    deadline = t0 + 2 * cfg.lease_ttl_s + cfg.heartbeat_s
    while True:
        rows = await fetch_rows(rows_dsn)
        gaps = await budget_gaps(watch.client, PREFIX, cluster.tenant_ids, rows)
        if all(g["gap"] == 0 for g in gaps.values()):
            return gaps, time.monotonic() - t0, rows
        if time.monotonic() > deadline:
            return gaps, None, rows
        await asyncio.sleep(0.5)


async def _run(cfg: ChaosConfig, cluster: Cluster, echo: Callable[[str], None]) -> ChaosResult:
    tenant_sets = [lease_key(PREFIX, f"tenant:{t}") for t in cluster.tenant_ids]
    replica_sets = [[lease_key(PREFIX, f"key:{ids[r]}", tag=f"tenant:{t}")
                     for t, ids in zip(cluster.tenant_ids, cluster.key_ids, strict=True)] for r in range(2)]
    watch = LeaseWatch(cluster.redis.url, PREFIX, tenant_sets, replica_sets, cluster.tenant_ids)
    plan = LoadPlan(cfg.num_requests, cfg.num_requests / cfg.duration_s, cfg.concurrency,
                    cluster.keys, [r.url for r in cluster.replicas], cfg.max_tokens,
                    cfg.stream_fraction, cfg.max_attempts, leave_fraction=cfg.leave_fraction,
                    timeout_s=cfg.client_timeout_s, run_id=f"chaos{secrets.token_hex(3)}", seed=cfg.seed)
    state = LoadState(run_id=plan.run_id)
    faults = plan_faults(cfg)
    stop = asyncio.Event()
    load_start: asyncio.Future = asyncio.get_running_loop().create_future()
    sampler = asyncio.create_task(watch.run(stop))
    try:
        echo(f"load: {cfg.num_requests} requests (or more, until the faults are over) at {plan.rate:.1f}/s; faults: "
             + ", ".join(f"{f.kind} ({f.target}) at {f.planned:.0f} s" for f in faults))
        driver = asyncio.create_task(drive_faults(faults, cfg, cluster, state, load_start, watch))

        def more() -> bool:   # slow restarts: the load goes on until every fault ended, and the tail
            return not all(f.ended for f in faults) or time.time() < max(f.ended for f in faults) + cfg.tail_s

        await run_load(plan, state, on_start=load_start.set_result, more=more)
        started = load_start.result()
        load_s = time.time() - started
        await driver
        notes = [f"{f.kind} at {f.started - started:.1f} s began after the last request started"
                 for f in faults if f.started > state.last_start]
        echo(f"load done in {load_s:.1f} s; waiting for the spool and the leases")
        await _settled(cluster)
        all_rows = await fetch_rows(cluster.pg.dsn)
        kills = [(int(f.target.split()[1]), f.killed_at) for f in faults if f.kind in KILLS]
        rows = check_rows(state.attempts, all_rows, kills)
        leases = await check_leases(watch, cfg.lease_ttl_s, cfg.heartbeat_s)
        stop.set()
        await sampler
        budgets, converged, _ = await _budgets(cfg, cluster, watch, cluster.pg.dsn)
        requests = len({a.request for a in state.attempts})
        killed = [killed_streams(f.mid_stream, snap.leases, state.attempts, all_rows, watch.reconciled_at)
                  for f, snap in zip([f for f in faults if f.kind in KILLS], watch.kills, strict=True)
                  if f.kind == "kill"]
        return ChaosResult(cfg, started, load_s, requests, state.attempts, faults, rows, leases,
                           budgets, converged, (watch.samples, watch.failed_samples), notes,
                           rows_by_route(state.attempts, all_rows, kills), killed)
    finally:
        stop.set()
        sampler.cancel()
        await watch.close()


async def run_chaos(cfg: ChaosConfig, work_dir: Path,
                    echo: Callable[[str], None] = lambda s: None) -> ChaosResult:
    """The whole run in `work_dir` (the model, the replicas' data and logs, Redis's dir)."""
    from lockgate.tenancy import db

    work_dir.mkdir(parents=True, exist_ok=True)
    with throwaway_postgres() as pg:
        redis = OwnRedis(work_dir)
        replicas: list[Replica] = []
        try:
            await asyncio.to_thread(db.upgrade, pg.url, "head")
            admin_key = "lg-" + secrets.token_urlsafe(32)
            replicas = _replicas(cfg, work_dir, pg, redis, admin_key)
            await asyncio.gather(*(asyncio.to_thread(r.start) for r in replicas))
            cluster = Cluster(pg, redis, replicas, admin_key)
            await asyncio.to_thread(_make_tenants, cfg, cluster)
            echo(f"2 replicas ({', '.join(r.url for r in replicas)}), {cfg.tenants} tenants")
            return await _run(cfg, cluster, echo)
        finally:
            for r in replicas:
                await asyncio.to_thread(r.stop)
            redis.stop()


# -- the report ---------------------------------------------------------------------------------
def _fmt_s(x: float | None) -> str:
    return "never" if x is None else f"{x:.2f} s"


def _route_lines(r: ChaosResult) -> list[str]:
    """Per route: its attempts and their rows; the streams each plain kill cut."""
    from collections import Counter

    lines = ["per route:"]
    for route, rep in r.by_route.items():
        mine = [a for a in r.attempts if a.route == route]
        outcomes = Counter(a.outcome for a in mine)
        with_row = {o: c["with_row"] for o, c in rep.by_outcome.items()}
        lines.append(
            f"  {route:<9} attempts {len(mine)} ({sum(a.stream for a in mine)} streamed; "
            + ", ".join(f"{o} {n}" for o, n in outcomes.most_common())
            + f"); rows {rep.rows}: 200s {rep.ok_attempts} with one row {with_row.get('ok', 0)}, "
            f"left {outcomes['left']} with a row {with_row.get('left', 0)}, cut {outcomes['cut']} with a row "
            f"{with_row.get('cut', 0)}; lost {rep.lost} / duplicated {rep.duplicated} / mismatched {rep.mismatched}")
    for n, k in enumerate(r.killed, 1):
        lines.append(f"  kill {n} cut mid-stream: " + ", ".join(
            f"{route} {c['mid_stream']} (cut {c['cut']}, leased {c['leased']}, settled or refunded {c['settled']}, "
            f"most rows {c['max_rows']})" for route, c in k.items())
            + ("" if set(k) == set(ROUTES) else " -- NOT every route"))
    return lines


def format_report(r: ChaosResult) -> list[str]:
    """The run's figures, as `lockgate bench chaos` prints them."""
    from collections import Counter

    outcomes = Counter(a.outcome for a in r.attempts)
    lines = [
        f"requests {r.requests}, attempts {len(r.attempts)} "
        f"({', '.join(f'{k} {v}' for k, v in outcomes.most_common())}), "
        f"requests answered 200 {r.requests_ok}, in {r.load_s:.1f} s",
    ]
    codes = Counter(f"{a.status} {a.error_code}" for a in r.attempts if a.outcome in ("refused", "stream_error"))
    if codes:
        lines.append("  refusals: " + ", ".join(f"{k} x{v}" for k, v in codes.most_common()))
    lines.append("faults:")
    for f, rec in zip(r.faults, r.recoveries(), strict=True):
        extra = (f", {f.in_flight} attempts in flight, {f.leases_at_kill} leases held"
                 if f.kind in KILLS else "")
        extra += f", replica ready at {f.ready - r.started:.1f} s" if f.kind == "overlap" else ""
        lines.append(f"  {f.kind:<13} {f.target:<9} at {f.started - r.started:6.1f} s, "
                     f"back at {f.ended - r.started:6.1f} s{extra}; time to recover {_fmt_s(rec)}")
    rows = r.rows
    lines.append(f"usage rows {rows.rows}: lost {rows.lost} / invented {rows.invented} / "
                 f"duplicated {rows.duplicated} / mismatched {rows.mismatched} "
                 f"(200 attempts {rows.ok_attempts})")
    for outcome, c in rows.by_outcome.items():
        lines.append(f"  {outcome:<12} attempts {c['attempts']:5d}, with a row {c['with_row']:5d} "
                     f"{c['row_statuses'] or ''}")
    lines += [f"  problem: {e}" for e in rows.examples]
    lines += _route_lines(r)
    le = r.leases
    lines.append(f"leases (ttl {le.ttl_s:g} s, heartbeat {le.heartbeat_s:g} s, bound ttl + heartbeat "
                 f"{le.ttl_s + le.heartbeat_s:g} s; {r.lease_samples[0]} samples, "
                 f"{r.lease_samples[1]} missed):")
    for k in le.kills:
        lines.append(f"  replica {k['replica']} killed: {k['leases']} leases ({k['live_at_kill']} live), "
                     f"all expired by kill + {_fmt_s(k['max_expiry_after_kill_s'])}, "
                     f"{k['over_bound']} past the bound; {k['reserved_tokens']} tokens reserved, "
                     f"reconciled by kill + {_fmt_s(k['reconciled_after_kill_s'])}")
    live = sum(le.live_after_deadline.values())
    lines.append(f"  live leases {le.checked_after_last_kill_s or 0:.1f} s after the last kill: {live}"
                 f" -> {'ok' if le.ok else 'FAILED'}")
    conv = ("converged " + _fmt_s(r.budgets_converged_s) + " after the checks began"
            if r.budgets_ok else "NOT equal")
    lines.append(f"budgets vs rows: {conv}")
    for tid, b in r.budgets.items():
        lines.append(f"  {tid}: day counter {b['counter']}, rows {b['rows']}, gap {b['gap']}")
    lines += [f"note: {n}" for n in r.notes]
    return lines


def bench_chaos(cfg: ChaosConfig, *, work_dir: Path | None = None, json_out: Path | None = None,
                echo: Callable[[str], None] = print) -> bool:
    """`lockgate bench chaos`: the run, its report, and whether every check passed. The work
    directory (replicas' logs) is kept when given or when a check failed."""
    import json
    import shutil
    import tempfile

    work = work_dir or Path(tempfile.mkdtemp(prefix="lockgate-chaos-"))
    result = asyncio.run(run_chaos(cfg, work, echo))
    for line in format_report(result):
        echo(line)
    if json_out is not None:
        json_out.write_text(json.dumps(result.to_dict(), indent=2, default=str))
    if work_dir is None and result.passed:
        shutil.rmtree(work, ignore_errors=True)
    else:
        echo(f"replica logs under {work}")
    echo("chaos: all checks passed" if result.passed else "chaos: CHECKS FAILED")
    return result.passed
