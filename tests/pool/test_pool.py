"""The engine pool on a real local Ray cluster (tests/pool/conftest.py): two workers on two
nodes, routing, placement, and a worker killed mid-request. Outputs are compared with HF
transformers; nothing here is timed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from lockgate.engine import EngineDead, ModelBinding, Pool, PoolConfig, SamplingParams
from lockgate.engine.config import EngineConfig
from lockgate.engine.model_pool import ModelPool
from lockgate.engine.pool.kv_index import engine_chain, engine_salt
from tests.support.helpers import demo_model, hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def dirs() -> dict[str, str]:
    return {"a": demo_model("llama", "tiny", 0), "b": demo_model("qwen2", "tiny", 1)}


def one_model_budget(dirs) -> int:
    probe = ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, dtype="float32",
                                   num_kv_blocks=64))
    sizes = [s.memory_bytes for s in probe.stats().pool.models.values()]
    return max(sizes) + min(sizes) // 2


@pytest.fixture
async def pool(ray_cluster, namespace, dirs):
    p = Pool(PoolConfig(address=ray_cluster.address, models=dirs, namespace=namespace,
                        engine_kwargs={"dtype": "float32", "num_kv_blocks": 64,
                                       "memory_budget": one_model_budget(dirs)},
                        report_interval_s=0.2, call_timeout_s=20.0))
    await p.start()
    try:
        yield p
    finally:
        await p.destroy()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def run(engine: ModelBinding, ids: list[int], rid: str, n: int = 8, tenant: str = "t1"):
    stream = engine.submit(ids, greedy(n), rid, tenant=tenant)
    await stream.accepted()
    outs = [o async for o in stream]
    stream.close()                                  # as the gateway does: forgets it once
    return outs[-1], stream.worker


async def test_two_models_on_budgets_of_one_are_served_at_once_and_equal_hf(pool, dirs):
    assert sorted(pool.assigned) == ["a", "b"]
    assert {tuple(w) for w in pool.assigned.values()} == {("lockgate-worker-0",), ("lockgate-worker-1",)}
    ea, eb = pool.for_model("a"), pool.for_model("b")
    pa = random_prompts(dirs["a"], [9, 23, 40], seed=1)
    pb = random_prompts(dirs["b"], [11, 31], seed=2)
    jobs = [run(ea, p, f"a{i}") for i, p in enumerate(pa)] + [run(eb, p, f"b{i}") for i, p in enumerate(pb)]
    results = await asyncio.gather(*jobs)
    for (out, worker), (model, ids) in zip(results, [("a", p) for p in pa] + [("b", p) for p in pb],
                                           strict=True):
        assert worker == pool.assigned[model][0]
        assert out.outputs[0].token_ids == hf_greedy(dirs[model], ids, 8)
    for s in [ea.submit(pa[0], greedy(2), "closed-early", tenant="t1")]:
        await s.accepted()
        s.close()                                   # closed before its end: aborted
    assert all(v == 0 for v in pool.inflight.values()), pool.inflight   # counted down once each
    await pool.refresh()
    workers = pool.snapshot().workers
    # each worker kept its own model resident the whole time: no switching
    assert {w: [m for m, r in v["models"].items() if r] for w, v in workers.items()} == \
        {pool.assigned["a"][0]: ["a"], pool.assigned["b"][0]: ["b"]}
    assert len({v["node"] for v in workers.values()} | {v["pid"] for v in workers.values()}) >= 2


async def test_a_shared_prefix_stays_on_one_worker_and_tenants_never_share_it(pool, dirs):
    engine = pool.for_model("a")
    pool.assigned = {"a": list(pool.names), "b": list(pool.names)}   # both may serve a
    pool.placement = None                                             # and stay so here
    (system,) = random_prompts(dirs["a"], [512], seed=3)
    tails = random_prompts(dirs["a"], [8] * 16, seed=4)
    first, worker = await run(engine, system + tails[0], "p0", n=2)
    results = [await run(engine, system + t, f"p{i}", n=2) for i, t in enumerate(tails[1:], 1)]
    assert {w for _, w in results} == {worker}
    assert first.num_cached_tokens == 0
    assert all(out.num_cached_tokens >= 496 for out, _ in results)    # 31 full blocks of 16
    other, _ = await run(engine, system + tails[0], "q0", n=2, tenant="t2")
    assert other.num_cached_tokens == 0                                # tenant-salted
    # distinct prefixes: spread over both workers
    distinct = random_prompts(dirs["a"], [64] * 12, seed=5)
    where = [w for _, w in await asyncio.gather(*(run(engine, p, f"d{i}", n=2)
                                                  for i, p in enumerate(distinct)))]
    counts = {w: where.count(w) for w in pool.names}
    assert min(counts.values()) >= len(where) / 3, counts
    await index_equals_the_workers_caches_after(pool, dirs, 200)


async def index_equals_the_workers_caches_after(pool: Pool, dirs, n: int) -> None:
    """`n` requests of a few tenants over a few shared prefixes, more than the workers' 64
    blocks hold (so they evict): the router's index, fed by the workers' KV events on their
    reports, then equals each worker's cached hash set, and it routed by it."""
    engine = pool.for_model("a")
    systems = random_prompts(dirs["a"], [96, 160, 48, 224], seed=11)
    tails = random_prompts(dirs["a"], [20] * n, seed=12)
    sem = asyncio.Semaphore(6)

    async def one(i: int):
        async with sem:
            return await run(engine, systems[i % 4] + tails[i], f"e{i}", n=1, tenant=f"t{i % 3}")

    outs = await asyncio.gather(*(one(i) for i in range(n)))
    assert sum(o.num_cached_tokens for o, _ in outs) > 0
    await pool.refresh()
    await pool.refresh()
    for w in pool.names:
        held = await pool.handles[w].kv_cached.remote()
        assert pool.kv_index.fresh(w)
        assert pool.kv_index.hashes(w) == held["device"], w
        assert held["device"]
    # the router's hashes of a prompt are the engine's: a prompt just served is found
    ids = systems[3] + tails[n - 1]
    chain = engine_chain(engine_salt("a", f"t{(n - 1) % 3}", None), ids, 16)
    assert max(pool.kv_index.match(w, chain) for w in pool.names) == len(chain)


async def test_a_second_replica_finds_prefixes_the_first_placed_from_the_workers_summaries(
        pool, ray_cluster, namespace, dirs):
    """Replica A places two tenants' prompts on the two workers (distinct prefixes, idle
    workers: one each). Replica B, which routed neither, learns where they are from the
    workers' reports: each goes to the worker holding it and reports its cached tokens."""
    replica_b = Pool(PoolConfig(address=ray_cluster.address, models=dirs, namespace=namespace,
                                engine_kwargs=pool.config.engine_kwargs,
                                report_interval_s=0.2, call_timeout_s=20.0))
    await replica_b.start()
    try:
        for p in (pool, replica_b):
            p.assigned = {"a": list(p.names), "b": list(p.names)}
            p.placement = None
        p1, p2 = random_prompts(dirs["a"], [256, 256], seed=7)
        (_, w1), (_, w2) = [await run(pool.for_model("a"), p, f"a{i}", n=2, tenant=f"t{i}")
                            for i, p in enumerate((p1, p2))]
        assert w1 != w2
        await replica_b.refresh()
        engine_b = replica_b.for_model("a")
        # B's own turn would send its first request to lockgate-worker-0: p2 first shows the
        # summary, not the turn, decides
        out2, where2 = await run(engine_b, [*p2, 5, 6, 7], "b2", n=2, tenant="t1")
        out1, where1 = await run(engine_b, [*p1, 5, 6, 7], "b1", n=2, tenant="t0")
        assert (where1, where2) == (w1, w2)
        assert out1.num_cached_tokens >= 240 and out2.num_cached_tokens >= 240
    finally:
        await replica_b.close()


async def test_a_killed_worker_fails_or_retries_its_requests_and_comes_back(pool, dirs):
    engine = pool.for_model("a")
    victim = pool.assigned["a"][0]
    pid = pool.reports[victim].pid
    prompts = random_prompts(dirs["a"], [20] * 5, seed=6)
    streams = []
    for i, p in enumerate(prompts):
        s = engine.submit(p, greedy(600), f"k{i}", tenant="t1")
        await s.accepted()
        streams.append(s)
    first = await streams[0].__anext__()                 # the first one is running
    assert first.outputs[0].token_ids
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    # a request sent to the dead worker before the pool noticed: retried on the other one
    late = engine.submit(prompts[1], greedy(8), "late", tenant="t1")
    await late.accepted()
    late_out = [o async for o in late][-1]
    assert late.worker != victim
    assert late_out.outputs[0].token_ids == hf_greedy(dirs["a"], prompts[1], 8)
    ended: dict[str, str] = {}
    for s in streams:
        try:
            async for out in s:
                if out.finished:
                    ended[s.request_id] = "finished"
        except EngineDead as exc:
            assert "failed" in str(exc)
            ended[s.request_id] = "dead"
    # a request that had sent tokens ends with EngineDead; none is left hanging
    assert ended["k0"] == "dead" and len(ended) == len(streams)
    # the pool sees the restart in its own state and serves on the new process
    while pool.reports[victim].pid == pid or victim in pool.down:
        await asyncio.sleep(0.2)
        await pool.refresh()
        assert time.monotonic() - killed_at < 120, "worker not restarted"
    print(f"worker {victim} restarted and serving {time.monotonic() - killed_at:.1f} s after the kill")
    assert pool.restarts[victim] == 1 and pool.reports[victim].started
    out, _ = await run(engine, prompts[0], "after", n=8)
    assert out.outputs[0].token_ids == hf_greedy(dirs["a"], prompts[0], 8)
