"""`lockgate bench pool`: the engine pool on a local two-node Ray cluster (each node lending one
device of one CPU thread), three comparisons printed side by side in one run:

1. routing: prefix affinity (the pool's `Router`) vs round-robin, on a multi-tenant workload
   whose tenants each share a long system prompt: prompt tokens computed (not served from a
   prefix cache) and TTFT p50/p99. Sized where routing matters: the tenants' prompts
   together (16 x 32 blocks) fill a worker's device cache twice, its device and host tiers
   together once, so a worker that sees every tenant (round-robin) cannot keep them all, and
   one that sees half can. (With every prompt fitting every worker, perfect caches bound the
   ratio at (2 x prompts + tails) / (prompts + tails): 1.5x for 8 tenants, whatever the router);
2. two models on one worker vs on two workers (budgets that hold one model each): the time
   for an alternating two-model workload;
3. the latency a pooled request adds over an embedded one (an `AsyncEngine` in this
   process): TTFT p50 of short sequential requests.

Each comparison alternates its sides `repeats` times on the same cluster and reports the
best run of each side. Loopback only; bounded request counts.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

from lockgate.loadtests.stats import percentile


def _greedy(n: int) -> Any:
    from lockgate.engine import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _one(engine: Any, ids: list[int], rid: str, tenant: str, n: int) -> tuple[float, int, int]:
    """(TTFT s, prompt tokens computed, total time s) of one request."""
    t0 = time.perf_counter()
    stream = engine.submit(ids, _greedy(n), rid, tenant=tenant)
    await stream.accepted()
    ttft = None
    last = None
    async for out in stream:
        if ttft is None:
            ttft = time.perf_counter() - t0
        last = out
    if last is None or ttft is None:
        raise RuntimeError(f"request {rid} ended without an output")
    return ttft, len(ids) - last.num_cached_tokens, time.perf_counter() - t0


class RoundRobin:
    """The baseline router: each request to the next worker, prefixes ignored."""

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, candidates, load, chain, **_):
        self.turn += 1
        return sorted(candidates)[self.turn % len(candidates)], 0

    def remember(self, chain, worker) -> None:
        pass

    def forget_worker(self, worker) -> None:
        pass

    def set_summary(self, worker, keys) -> None:
        pass


def _jobs(systems: list[list[int]], tails: list[list[int]], skew: float | None) -> list[tuple[str, list[int]]]:
    """One request per tail: with `skew`, that share of them carries tenant t0's prefix and the
    rest are spread over the other tenants; without, every tenant alike."""
    rng = random.Random(len(tails))
    n = len(systems)
    if skew is None or n == 1:
        who = [i % n for i in range(len(tails))]
    else:
        hot = round(skew * len(tails))
        who = [0] * hot + [1 + i % (n - 1) for i in range(len(tails) - hot)]
    jobs = [(f"t{k}", systems[k] + tail) for k, tail in zip(who, tails, strict=True)]
    rng.shuffle(jobs)        # arrivals in no tenant order
    return jobs


async def _sample_inflight(pool: Any, into: list[dict[str, int]]) -> None:
    """Each worker's requests in flight from this replica, every 10 ms."""
    while True:
        into.append({w: pool.inflight[w] for w in pool.names})
        await asyncio.sleep(0.01)


def _inflight_ratio(samples: list[dict[str, int]]) -> float:
    """The busiest worker's time-averaged in-flight count over the idlest's."""
    if not samples:
        return 1.0
    avg = {w: sum(s[w] for s in samples) / len(samples) for w in samples[0]}
    return max(avg.values()) / max(min(avg.values()), 1e-9)


async def _routing(pool: Any, model_dir: str, tenants: int, per_tenant: int, prefix: int,
                   skew: float | None = None, concurrency: int = 4) -> dict:
    from lockgate.loadtests.workload import prompts_for

    engine = pool.for_model("a")
    systems = prompts_for(model_dir, [prefix] * tenants, seed=secrets.randbelow(10**6))
    tails = prompts_for(model_dir, [16] * (tenants * per_tenant), seed=secrets.randbelow(10**6))
    jobs = _jobs(systems, tails, skew)
    sem = asyncio.Semaphore(concurrency)

    async def go(i: int, tenant: str, ids: list[int]):
        async with sem:
            return await _one(engine, ids, f"r{secrets.token_hex(4)}-{i}", tenant, 4)

    samples: list[dict[str, int]] = []
    sampler = asyncio.get_running_loop().create_task(_sample_inflight(pool, samples))
    t0 = time.perf_counter()
    try:
        res = await asyncio.gather(*(go(i, t, ids) for i, (t, ids) in enumerate(jobs)))
    finally:
        sampler.cancel()
    ttfts = sorted(r[0] for r in res)
    return {"computed_tokens": sum(r[1] for r in res), "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
            "ttft_p99_ms": percentile(ttfts, 99) * 1e3, "wall_s": time.perf_counter() - t0,
            "inflight_ratio": _inflight_ratio(samples)}


async def _two_models(pool: Any, dirs: dict[str, str], n: int) -> float:
    from lockgate.loadtests.workload import prompts_for

    engines = {m: pool.for_model(m) for m in dirs}
    prompts = {m: prompts_for(d, [24] * n, seed=3) for m, d in dirs.items()}
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(4)

    async def go(m: str, i: int):
        async with sem:
            return await _one(engines[m], prompts[m][i], f"{m}-{secrets.token_hex(4)}-{i}", "t", 16)

    await asyncio.gather(*(go(m, i) for i in range(n) for m in dirs))
    return time.perf_counter() - t0


def _best(runs: list[dict], key: str) -> dict:
    return min(runs, key=lambda r: r[key])


async def _compare_routing(make: Callable, dirs: dict[str, str], repeats: int, tenants: int,
                           per_tenant: int, prefix: int, skew: float | None = None) -> dict:
    """1. model a on both workers, routed by prefix affinity and round-robin in turn; each
    side's run with the best TTFT p99, with the fewest prompt tokens and the evenest in-flight
    counts any of its runs had."""
    pool = await make(2, {"a": dirs["a"]})
    pool.assigned = {"a": list(pool.names)}
    pool.placement = None                  # keep both workers on it
    affinity_router = pool.router
    runs: dict[str, list[dict]] = {"affinity": [], "round_robin": []}
    for warm in (RoundRobin(), affinity_router):    # a warm-up of each, not counted: the
        pool.router = warm                           # workers' first steps of each batch shape
        await _routing(pool, dirs["a"], tenants, per_tenant, prefix, skew)
    for k in range(repeats):          # each side first in turn
        for side in ("affinity", "round_robin")[::1 if k % 2 == 0 else -1]:
            pool.router = affinity_router if side == "affinity" else RoundRobin()
            runs[side].append(await _routing(pool, dirs["a"], tenants, per_tenant, prefix, skew))
    await pool.destroy()
    return {s: _best(r, "ttft_p99_ms") | {"computed_tokens": min(x["computed_tokens"] for x in r),
                                          "inflight_ratio": min(x["inflight_ratio"] for x in r)}
            for s, r in runs.items()}


async def _compare_two_models(make: Callable, dirs: dict[str, str], repeats: int, requests: int) -> dict:
    """2. both models on one worker vs on two: each side's best time, once both are loaded.
    The cluster lends two devices: each side's pool is made and destroyed in its turn."""
    times: dict[str, list[float]] = {"one_worker": [], "two_workers": []}
    for _ in range(repeats):
        for side, n in (("one_worker", 1), ("two_workers", 2)):
            p = await make(n, dirs)
            try:
                await _two_models(p, dirs, 2)               # warm: both models loaded once
                times[side].append(await _two_models(p, dirs, requests))
            finally:
                await p.destroy()
    return {s: min(t) for s, t in times.items()}


async def _compare_latency(make: Callable, dirs: dict[str, str], engine_kwargs: dict[str, Any],
                           repeats: int, requests: int) -> dict:
    """3. TTFT p50 of short sequential requests, pooled vs an embedded `AsyncEngine`; each
    side's best."""
    from lockgate.engine import AsyncEngine
    from lockgate.loadtests.workload import prompts_for

    pool = await make(1, {"a": dirs["a"]})
    local = AsyncEngine(dirs["a"], **{k: v for k, v in engine_kwargs.items() if k != "memory_budget"})
    await local.start()
    ids = prompts_for(dirs["a"], [16] * requests, seed=9)
    lat: dict[str, list[float]] = {"embedded": [], "pooled": []}
    for _ in range(repeats):
        for side, eng in (("embedded", local), ("pooled", pool.for_model("a"))):
            ts = sorted([(await _one(eng, p, f"l{secrets.token_hex(4)}", "t", 2))[0] for p in ids])
            lat[side].append(percentile(ts, 50) * 1e3)
    await local.shutdown()
    await pool.destroy()
    return {s: min(v) for s, v in lat.items()}


def _one_model_budget(dirs: dict[str, str]) -> int:
    """A memory budget that holds the larger model and half the smaller: one at a time."""
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.model_pool import ModelPool

    probe = ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, dtype="float32",
                                   num_kv_blocks=256))
    sizes = [s.memory_bytes for s in probe.stats().pool.models.values()]
    return max(sizes) + min(sizes) // 2


def _print_routing(r: dict, echo: Callable[[str], None]) -> None:
    a, b = r["affinity"], r["round_robin"]
    echo(f"routing ({r.get('workload', 'shared-prefix tenants')})  affinity      round-robin   ratio")
    echo(f"  prompt tokens computed           {a['computed_tokens']:>9}     {b['computed_tokens']:>9}     "
         f"{b['computed_tokens'] / max(1, a['computed_tokens']):.2f}x fewer (target >= 1.5x)")
    for k in ("ttft_p50_ms", "ttft_p99_ms"):
        echo(f"  {k:<30} {a[k]:>9.1f}     {b[k]:>9.1f}     {b[k] / max(1e-9, a[k]):.2f}x"
             + (" of round-robin's speed (target >= 0.95x)" if k == "ttft_p99_ms" else ""))
    echo(f"  busiest/idlest in flight (10 ms) {a['inflight_ratio']:>9.2f}     {b['inflight_ratio']:>9.2f}"
         "     (target <= 2x)")


def _print_comparisons(out: dict, echo: Callable[[str], None]) -> None:
    _print_routing(out["routing"], echo)
    if "two_models" not in out:
        return
    t, lat = out["two_models"], out["latency_ttft_p50_ms"]
    echo(f"two models, one-model budgets      one worker {t['one_worker']:.2f} s   two workers "
         f"{t['two_workers']:.2f} s   {t['one_worker'] / t['two_workers']:.2f}x")
    echo(f"TTFT p50 of a short request        embedded {lat['embedded']:.1f} ms   pooled "
         f"{lat['pooled']:.1f} ms   added {lat['pooled'] - lat['embedded']:.1f} ms")


def bench_pool(*, repeats: int = 3, tenants: int = 16, per_tenant: int = 16, prefix: int = 512,
               skew: float | None = 0.7, routing_only: bool = False,
               two_model_requests: int = 12, latency_requests: int = 30,
               echo: Callable[[str], None] = print) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from lockgate.engine import Pool, PoolConfig
    from lockgate.loadtests.workload import demo_dir

    dirs = {"a": demo_dir("llama", "tiny", 0), "b": demo_dir("qwen2", "tiny", 1)}
    kw = {"dtype": "float32", "num_kv_blocks": 256, "memory_budget": _one_model_budget(dirs)}
    args = {"num_cpus": 1, "resources": {"lockgate_device": 1}}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    cluster.add_node(**args)
    cluster.wait_for_nodes()
    out: dict[str, Any] = {}

    async def main() -> None:
        async def make(workers: int, models: dict[str, str]) -> Any:
            p = Pool(PoolConfig(address=cluster.address, models=models, engine_kwargs=kw,
                                namespace=f"bench-{secrets.token_hex(3)}", workers=workers,
                                report_interval_s=0.25, start_timeout_s=120))
            await p.start()
            return p

        out["routing"] = await _compare_routing(make, dirs, repeats, tenants, per_tenant, prefix, skew)
        out["routing"]["workload"] = (f"skewed: {skew:.0%} on one prefix" if skew is not None
                                      else "shared-prefix tenants")
        if routing_only:
            return
        out["two_models"] = await _compare_two_models(make, dirs, repeats, two_model_requests)
        out["latency_ttft_p50_ms"] = await _compare_latency(make, dirs, kw, repeats, latency_requests)

    try:
        asyncio.run(main())
    finally:
        ray.shutdown()
        cluster.shutdown()
    _print_comparisons(out, echo)
    return out
