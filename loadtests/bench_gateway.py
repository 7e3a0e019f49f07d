"""`lockgate bench gateway`: the latency the gateway ADDS to a request, measured with an engine
that answers at once (loadtests/instant_engine.py), so what is left is the gateway's own work.

The gateway runs as in production, in a subprocess of its own: one uvicorn worker serving
`create_app(Settings(database_url=..., redis_url=..., migrate=True), engine_factory=InstantEngine)`
(loadtests/gateway_bench_server.py) on a scratch PostgreSQL database (`lockgate_bench_<pid>`,
dropped afterwards) and Redis under a unique key prefix (deleted afterwards). A tenant and a key
are made through the admin API with a generous quota, so every request makes the limiter's real
Lua calls (acquire and settle) without ever being refused, and every response waits for its usage
row's group commit, as in production.

Load: an open-loop generator (request i is due at t0 + i/rate whatever happened before) per
rate step, non-streaming POST /v1/chat/completions with max_tokens 8 to 127.0.0.1, through
aiohttp with a pool of kept-alive connections (in one process, or `--clients N`
processes each sending rate/N). A request's latency runs from its send to its full response.
The generator's own health is reported with it: the rate it actually sent, its lag behind the
schedule (p99), and the CPU it used, next to the gateway process's CPU and the machine's.

Baseline, in the same run: the same InstantEngine called directly in-process (submit, iterate,
close) at the same rates, timed the same way. Added latency = gateway p50/p99 minus direct
p50/p99. Also measured (unless --no-floor): a bare uvicorn app answering a fixed body, with the
same client, at the reference rate: the floor of HTTP alone.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockgate.loadtests.cache import demo_model_dir
from lockgate.loadtests.harness.cpu import CpuMeter
from lockgate.loadtests.harness.load import (
    MAX_CONNECTIONS,
    MAX_TOKENS,
    MESSAGES,
    MODEL_NAME,
    Clients,
    freeze_heap,
    open_loop,
    run_loop,
)
from lockgate.loadtests.harness.report import generator_state, jsonable, nearest, print_report, summarize
from lockgate.loadtests.harness.server import ServerProcess
from lockgate.loadtests.harness.services import ServiceUnavailable, check_services, pg_dsn, pg_execute, redis_keys

__all__ = ["ServiceUnavailable", "bench_gateway"]

# Generous: every limit is checked on every request (a real Lua call each way), none is hit.
GENEROUS_QUOTA = {"requests_per_minute": 100_000_000, "tokens_per_minute": 10_000_000_000,
                  "max_concurrent_requests": 1_000_000, "daily_token_budget": 10**15,
                  "monthly_token_budget": 10**16}
DEFAULT_RATES = (100, 200, 300, 400, 500, 600)
BENCH_SERVER = ("lockgate.loadtests.gateway_bench_server",)


class BenchServer(ServerProcess):
    name = "the gateway"


# -- the model directory (only its tokenizer and config are read) -----------------------------
def default_model_dir() -> Path:
    """The tiny llama demo model, written once under `cache_dir()`."""
    return demo_model_dir("llama", "tiny", 0)


# -- the direct baseline ------------------------------------------------------------------------------
async def _direct_steps(model_dir: str, rates: list[float], duration: float) -> list[dict]:
    from lockgate.engine import SamplingParams
    from lockgate.loadtests.instant_engine import InstantEngine

    engine = InstantEngine(model_dir)
    await engine.start()
    ids = engine.tokenizer.encode(MESSAGES[0]["content"], add_special_tokens=False)
    counter = iter(range(10**12))

    async def call() -> str | None:
        stream = engine.submit(ids, SamplingParams(max_tokens=MAX_TOKENS), f"direct-{next(counter)}",
                               tenant="bench", service_class="online", priority=0,
                               cache_salt="bench:")
        try:
            last = None
            async for out in stream:
                last = out
        finally:
            stream.close()
        return None if last is not None and last.finished else "unfinished"

    out = []
    try:
        for _ in range(200):                    # warm-up
            await call()
        freeze_heap()
        for rate in rates:
            t0 = time.perf_counter() + 0.05
            res = await open_loop(call, rate, max(1, round(rate * duration)), t0)
            res["rate"] = rate
            out.append(res)
    finally:
        await engine.shutdown()
    return out


def _measure(pool: Clients, url: str, key: str, rate: float, duration: float, server_proc: Any,
             repeats: int) -> tuple[dict[str, Any], int]:
    """Run a step `repeats` times; the attempt with the fewest errors, then the lowest p99,
    counts (a shared machine's neighbours inflate some attempts). Returns it and the number of
    successful responses over all attempts (each has its usage row)."""
    meter = CpuMeter(server_proc)
    best: dict[str, Any] | None = None
    attempts = []
    ok = 0
    for _ in range(repeats):
        meter.start()
        raw = pool.step(url, key, rate, duration)
        row = summarize(raw, rate, duration)
        row.update(meter.stop(row["client_cpu"]))
        ok += raw["prime_ok"] + row["ok"]
        attempts.append({k: row[k] for k in ("p50_ms", "p99_ms", "errors", "achieved_rps",
                                             "others_cpu")})
        if best is None or (row["errors"], row["p99_ms"]) < (best["errors"], best["p99_ms"]):
            best = row
    if best is None:
        raise ValueError("repeats: must be >= 1")
    best["attempts"] = attempts
    return best, ok


# -- the run ---------------------------------------------------------------------------------------
@dataclass
class _Run:
    """One benchmark run's settings and what it has gathered so far."""

    rates: list[float]
    duration: float
    clients: int
    repeats: int
    warmup_s: float
    max_time_s: float
    echo: Any
    t_begin: float = field(default_factory=time.monotonic)
    results: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ok_total: int = 0


def _check(rates: list[float] | None, duration: float, clients: int, repeats: int) -> list[float]:
    out = sorted(float(r) for r in (rates or DEFAULT_RATES))
    if not out or any(r <= 0 for r in out):
        raise ValueError("rates: give one or more positive request rates")
    if duration <= 0:
        raise ValueError("duration: must be > 0")
    if clients < 1:
        raise ValueError("clients: must be >= 1")
    if repeats < 1:
        raise ValueError("repeats: must be >= 1")
    return out


def _gateway_env(db_url: str, redis_url: str, prefix: str, admin_key: str, data_dir: Path,
                 model_dir: str, synchronous_commit: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
    env.update({
        "LOCKGATE_DATABASE_URL": db_url, "LOCKGATE_REDIS_URL": redis_url,
        "LOCKGATE_REDIS_PREFIX": prefix, "LOCKGATE_MIGRATE": "true",
        "LOCKGATE_ADMIN_KEY": admin_key, "LOCKGATE_PEPPER": secrets.token_hex(32),
        "LOCKGATE_DATA_DIR": str(data_dir),
        "LOCKGATE_MODELS": json.dumps([f"{MODEL_NAME}={model_dir}"]),
        "LOCKGATE_USAGE_SYNCHRONOUS_COMMIT": "true" if synchronous_commit else "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    })
    return env


def _bench_key(url: str, admin_key: str) -> str:
    """A tenant and a key with GENEROUS_QUOTA, made through the admin API."""
    import httpx

    with httpx.Client(base_url=url + "/admin/v1", timeout=30,
                      headers={"authorization": f"Bearer {admin_key}"}) as admin:
        r = admin.post("/tenants", json={"name": "bench", "quota": GENEROUS_QUOTA})
        r.raise_for_status()
        tenant = r.json()
        r = admin.post(f"/tenants/{tenant['id']}/keys", json={"name": "bench", "quota": GENEROUS_QUOTA})
        r.raise_for_status()
        return r.json()["key"]


def _rate_steps(run: _Run, pool: Clients, server: ServerProcess, key: str,
                direct: dict[float, dict]) -> None:
    """The warm-up (not reported: connections, the key cache, the pools, the Lua script), then
    each rate step until the gateway no longer keeps up or --max-time is reached."""
    import psutil

    gw_proc = psutil.Process(server.proc.pid)
    warm = pool.step(server.url, key, run.rates[0], run.warmup_s)
    run.ok_total += warm["prime_ok"] + sum(1 for x in warm["lat"] if not math.isnan(x))
    if sum(1 for x in warm["lat"] if not math.isnan(x)) == 0:
        raise RuntimeError(f"every warm-up request failed: {warm['examples'][:2]}\n{server.log_excerpt()}")
    for rate in run.rates:
        if time.monotonic() - run.t_begin + run.duration * run.repeats + 5 > run.max_time_s:
            run.notes.append(f"stopped before {rate:g} req/s: --max-time {run.max_time_s:g} s reached")
            break
        row, ok = _measure(pool, server.url, key, rate, run.duration, gw_proc, run.repeats)
        run.ok_total += ok
        d = direct[rate]
        row["direct_p50_ms"], row["direct_p99_ms"] = d["p50_ms"], d["p99_ms"]
        row["added_p50_ms"] = row["p50_ms"] - d["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - d["p99_ms"]
        row["generator"] = generator_state(row, run.clients)
        row["generator_limited"] = row["generator"] == "limited"
        run.results.append(row)
        run.echo(f"  {rate:>6g} req/s: achieved {row['achieved_rps']:7.1f}, p50 {row['p50_ms']:6.2f} ms, "
                 f"p99 {row['p99_ms']:7.2f} ms, errors {row['errors']}")
        if row["achieved_rps"] < 0.7 * rate or row["p99_ms"] > 2000 or row["ok"] == 0:
            run.notes.append(f"stopped after {rate:g} req/s: the gateway no longer keeps up")
            break


def _floor(run: _Run, pool: Clients, env: dict[str, str], log_path: Path,
           ref_rate: float) -> dict[str, Any]:
    """The HTTP floor: bare uvicorn, the same client, at the reference rate."""
    import psutil

    ref = nearest(run.rates, ref_rate)
    srv = BenchServer.launch(BENCH_SERVER, env, log_path, extra_args=["--null"])
    try:
        proc = psutil.Process(srv.proc.pid)
        pool.step(srv.url, "x", ref, min(1.0, run.warmup_s))
        floor_res, _ = _measure(pool, srv.url, "x", ref, run.duration, proc, run.repeats)
    finally:
        srv.stop()
    return floor_res


def _echo_setup(db_dsn: str, redis_url: str, prefix: str, model_dir: str, duration: float, clients: int,
                echo) -> None:
    """What the gateway runs on, and the load it is sent."""
    echo(f"gateway benchmark: 1 uvicorn worker, PostgreSQL {db_dsn}, "
         f"Redis {redis_url} (prefix {prefix}), instant engine on {model_dir}")
    echo(f"load: open loop, non-streaming chat completions, max_tokens {MAX_TOKENS}, "
         f"{duration:g} s per rate, {clients} client process{'es' if clients > 1 else ''} "
         f"(aiohttp: up to {MAX_CONNECTIONS} kept-alive connections, uvloop); {os.cpu_count()} CPUs on this machine")


def _drop_scratch(admin_dsn: str, db_name: str, redis_url: str, prefix: str, echo) -> None:
    """Drop the scratch database and delete the Redis keys under `prefix`; a failure warns,
    never masks the run's outcome."""
    try:
        pg_execute(admin_dsn, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
    except Exception as exc:  # noqa: BLE001 - cleanup warns, never masks the run's outcome
        echo(f"warning: could not drop the scratch database {db_name}: {exc!r}")
    try:
        redis_keys(redis_url, prefix, delete=True)
    except Exception as exc:  # noqa: BLE001
        echo(f"warning: could not delete the Redis keys under {prefix}: {exc!r}")


def bench_gateway(
    *,
    database_url: str = "postgresql://postgres@127.0.0.1:5432/test",
    redis_url: str = "redis://127.0.0.1:6379/0",
    rates: list[float] | None = None,
    duration: float = 5.0,
    model_dir: str | None = None,
    clients: int = 1,
    repeats: int = 1,
    ref_rate: float = 300.0,
    floor: bool = True,
    warmup_s: float = 2.0,
    max_time_s: float = 300.0,
    json_out: str | None = None,
    echo=print,
    synchronous_commit: bool = True,
) -> dict[str, Any]:
    """Run the benchmark; print the table and the verdicts; return (and optionally write) the
    results. Raises ServiceUnavailable when PostgreSQL or Redis does not answer.
    `synchronous_commit=False` runs the gateway with `usage_synchronous_commit` off."""
    run = _Run(_check(rates, duration, clients, repeats), duration, clients, repeats, warmup_s,
               max_time_s, echo)
    check_services(database_url, redis_url)
    model_dir = str(model_dir or default_model_dir())
    pid = os.getpid()
    db_name = f"lockgate_bench_{pid}"
    prefix = f"lockgate_bench:{pid}:{secrets.token_hex(4)}:"
    admin_dsn = pg_dsn(database_url)
    db_url = pg_dsn(database_url, db_name).replace("postgresql://", "postgresql+asyncpg://", 1)
    admin_key = "lg-" + secrets.token_urlsafe(32)
    _echo_setup(pg_dsn(database_url, db_name), redis_url, prefix, model_dir, duration, clients, echo)

    # 1. the direct baseline, before anything else runs
    direct_raw = run_loop(_direct_steps(model_dir, run.rates, min(duration, 3.0)))
    direct = {d["rate"]: summarize(d, d["rate"], min(duration, 3.0)) for d in direct_raw}

    floor_res: dict[str, Any] | None = None
    usage_rows = redis_key_count = None
    tmp = tempfile.TemporaryDirectory(prefix="lockgate-bench-")
    server: ServerProcess | None = None
    client_pool: Clients | None = None
    pg_execute(admin_dsn, f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)',
               f'CREATE DATABASE "{db_name}"')
    try:
        env = _gateway_env(db_url, redis_url, prefix, admin_key, Path(tmp.name) / "data", model_dir,
                           synchronous_commit)
        server = BenchServer.launch(BENCH_SERVER, env, Path(tmp.name) / "gateway.log")
        echo("usage rows: " + ("each response waits for its batch's durable commit" if synchronous_commit
                               else "committed with synchronous_commit off (no wait for the WAL flush)"))
        key = _bench_key(server.url, admin_key)
        client_pool = Clients(clients)
        # 2. warm-up and 3. the rate steps
        _rate_steps(run, client_pool, server, key, direct)
        # 4. what the gateway wrote: one usage row per answered request, limiter keys in Redis
        usage_rows = pg_execute(pg_dsn(database_url, db_name), "SELECT count(*) FROM usage_records")[0]
        redis_key_count = redis_keys(redis_url, prefix, delete=False)
        server.stop()
        server = None
        # 5. the HTTP floor
        if floor:
            floor_res = _floor(run, client_pool, env, Path(tmp.name) / "null.log", ref_rate)
    finally:
        if client_pool is not None:
            client_pool.close()
        if server is not None:
            server.stop()
        _drop_scratch(admin_dsn, db_name, redis_url, prefix, echo)
        tmp.cleanup()

    report = print_report(run.results, direct, floor_res, ref_rate, clients, usage_rows, run.ok_total,
                          redis_key_count, run.notes, echo)
    report["elapsed_s"] = time.monotonic() - run.t_begin
    report["database"] = db_name          # dropped by now
    report["redis_prefix"] = prefix       # deleted by now
    if json_out:
        Path(json_out).write_text(json.dumps(jsonable(report), indent=2))
    return report
