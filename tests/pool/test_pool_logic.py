"""The pool's decisions without Ray: routing (`Router`), placement (`Placement`) and a worker's
own checks (`EngineWorker` as a plain object, its model files, its owners' keepalives)."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.engine import SamplingParams
from lockgate.engine.pool import (
    EngineWorker,
    ModelFilesMissing,
    Placement,
    PrefixSummary,
    Router,
    prefix_chain,
    request_chain,
    unpack_summary,
)
from tests.support.helpers import demo_model, random_prompts


def test_prefix_chains_are_salted_and_cover_full_blocks_only():
    ids = list(range(100, 140))                       # 40 tokens: two full blocks of 16
    a, b = prefix_chain("m\0t1\0", ids), prefix_chain("m\0t2\0", ids)
    assert len(a) == 2 and len(b) == 2 and not set(a) & set(b)
    assert prefix_chain("m\0t1\0", [*ids[:32], 1, 2]) == a          # same full blocks
    assert prefix_chain("m\0t1\0", [7, *ids[1:]])[0] != a[0]


def test_router_keeps_a_prefix_on_its_worker_unless_it_is_much_busier():
    r = Router()
    load = {"w0": 0, "w1": 0}
    chain = prefix_chain("s", list(range(64)))
    first, depth = r.choose(["w0", "w1"], load.get, chain)
    assert depth == 0
    again, depth = r.choose(["w0", "w1"], load.get, chain)
    assert again == first and depth == len(chain)
    other = "w1" if first == "w0" else "w0"
    load[first] = 3                                    # its queue costs more than the prefill saved
    moved, depth = r.choose(["w0", "w1"], load.get, chain)
    assert moved == other and depth == 0
    r.forget_worker(other)
    load[first] = 0
    assert r.choose(["w0", "w1"], load.get, chain) == (first, len(chain))     # still held there too
    with pytest.raises(ValueError, match="no worker"):
        r.choose([], load.get, chain)


def test_a_workers_prefix_summary_is_bounded_lru_and_versioned_by_membership():
    summary = PrefixSummary(capacity=5)
    a, b = prefix_chain("m\0t1\0", list(range(64))), prefix_chain("m\0t1\0", list(range(500, 564)))
    v0 = summary.version
    summary.add(a[:3])
    v1 = summary.version
    assert v1 != v0 and len(summary) == 3
    summary.add(a[:2])                       # already held: order moves, membership does not
    assert summary.version == v1
    summary.add(b[:3])                       # over capacity: a[2] (least recently used) goes
    keys = unpack_summary(summary.packed())
    assert len(summary) == 5 and len(summary.packed()) == 5 * 8
    assert a[2][:8] not in keys and {h[:8] for h in a[:2] + b[:3]} == keys
    summary.clear()
    assert len(summary) == 0 and summary.version != v1


def test_a_replica_finds_a_prefix_another_replica_placed_through_the_workers_summary():
    """Replica A routes a tenant's prefix to a worker; that worker's summary (as its report
    carries it) reaches replica B, which never routed it: B sends the same prefix there, the
    longest held prefix winning, but not another tenant's, and not past the load slack."""
    a, b = Router(), Router()
    load = {"w0": 0, "w1": 0}
    shared = list(range(1000, 1128))                  # 8 full blocks
    chain = prefix_chain("m\0t1\0", shared)
    where, _ = a.choose(["w0", "w1"], load.get, chain)
    other = "w1" if where == "w0" else "w0"
    held = PrefixSummary(capacity=100)
    held.add(chain)
    b.set_summary(where, unpack_summary(held.packed()))
    shorter = PrefixSummary(capacity=100)
    shorter.add(chain[:2])                            # the other worker holds a shorter prefix
    b.set_summary(other, unpack_summary(shorter.packed()))
    for _ in range(4):
        assert b.choose(["w0", "w1"], load.get, prefix_chain("m\0t1\0", [*shared, 5, 6]))[0] == where
    _, depth = b.choose(["w0", "w1"], load.get, prefix_chain("m\0t2\0", shared))
    assert depth == 0                                 # another tenant's chain: salted apart
    fresh = Router()
    fresh.set_summary(where, unpack_summary(held.packed()))
    load[where] = 5                                   # far busier than the other
    assert fresh.choose(["w0", "w1"], load.get, chain) == (other, 0)
    fresh.forget_worker(where)                        # restarted: its summary is gone
    assert fresh.summaries.get(where) is None


def test_a_cache_hint_keeps_a_tenants_requests_on_one_worker_whatever_their_prompts():
    """OpenAI's `prompt_cache_key`: prompts shorter than a block, or differing in their first
    block, go where the hint went before; a longer cached prefix still wins over the hint; the
    same hint of another tenant is another key; without a hint they spread in turn."""
    r = Router()
    load = {"w0": 0, "w1": 0}
    hinted = [r.choose(["w0", "w1"], load.get, request_chain("m", "t1", None, [i] * n, "conv-7"))[0]
              for i, n in ((1, 3), (2, 40), (3, 17), (4, 5))]
    assert len(set(hinted)) == 1
    home = hinted[0]
    other = "w1" if home == "w0" else "w0"
    plain = [r.choose(["w0", "w1"], load.get, request_chain("m", "t1", None, [i] * 3))[0] for i in range(6)]
    assert set(plain) == {"w0", "w1"}                 # the hint, not the tenant, held them together
    long_prompt = list(range(900, 964))
    r.remember(request_chain("m", "t1", None, long_prompt), other)
    assert r.choose(["w0", "w1"], load.get, request_chain("m", "t1", None, long_prompt, "conv-7"))[0] == other
    theirs = request_chain("m", "t2", None, [1] * 3, "conv-7")
    assert theirs[0] not in {request_chain("m", "t1", None, [1] * 3, "conv-7")[0]}
    load[home] = 5                                    # much busier: the hint yields to the load bound
    assert r.choose(["w0", "w1"], load.get, request_chain("m", "t1", None, [9] * 3, "conv-7"))[0] == other


def test_router_spreads_distinct_prefixes_in_turn():
    r = Router()
    got = [r.choose(["w0", "w1"], lambda w: 0, prefix_chain("s", [i] * 32))[0] for i in range(10)]
    assert got.count("w0") == got.count("w1") == 5


def test_placement_places_on_free_places_then_evicts_the_coldest():
    p = Placement(["w0", "w1"], {"w0": 1, "w1": 1})
    assert p.workers_for("a", {}, now=0) == ["w0"]
    assert p.workers_for("b", {}, now=0) == ["w1"]
    # c is asked for with no free place: the coldest model with demand 0 gives its place
    assert p.workers_for("c", {"a": 5, "b": 0}, now=10) == ["w1"]
    assert p.assigned["b"] == [] and p.assigned["a"] == ["w0"]
    reasons = [(d.model, d.action, d.reason) for d in p.decisions]
    assert ("b", "remove", "gave its place to c (demand 0)") in reasons
    assert ("c", "place", "asked for; took the place of b, the coldest") in reasons


def test_placement_gives_a_hot_model_another_worker_and_takes_it_back_when_cold():
    p = Placement(["w0", "w1"], {"w0": 2, "w1": 2}, hot_per_worker=4, cold_s=30, min_turn_s=5)
    p.workers_for("a", {}, now=0)
    p.rebalance({"a": 20}, now=10)                     # 20 queued on one worker: hot
    assert sorted(p.assigned["a"]) == ["w0", "w1"]
    assert p.decisions[-1].reason == "hot: 20 requests on 1 worker(s)"
    p.rebalance({"a": 0}, now=12)                      # within min_turn_s: no change
    assert len(p.assigned["a"]) == 2
    p.rebalance({"a": 0}, now=50)                      # no demand for 40 s > cold_s
    assert p.assigned["a"] == ["w0"] and p.decisions[-1].action == "remove"
    p.rebalance({"a": 0}, now=200)                     # never below one worker
    assert p.assigned["a"] == ["w0"]
    assert p.snapshot()["decisions"][-1]["reason"].startswith("cold")


def test_a_worker_refuses_to_start_without_its_model_files(tmp_path):
    w = EngineWorker("w", {"a": str(tmp_path / "missing")}, {})
    with pytest.raises(ModelFilesMissing, match=r"a=.*missing"):
        asyncio.run(w.start())
    with pytest.raises(ValueError, match="at least one model"):
        EngineWorker("w", {}, {})


async def test_a_silent_owners_requests_are_aborted():
    """A gateway replica that stops sending keepalives (it died): after `owner_ttl_s` its
    requests are aborted on the worker, their KV freed."""
    path = demo_model("llama", "tiny", 0)
    w = EngineWorker("w", {"a": path}, {"dtype": "float32", "num_kv_blocks": 64}, owner_ttl_s=0.3)
    await w.start()
    try:
        ids = random_prompts(path, [12], seed=1)[0]
        gen = w.generate("gw-dead", ids, SamplingParams(max_tokens=1500, ignore_eos=True), "r1", {})
        assert (await gen.__anext__())[0] == "accepted"
        outs = []
        async for _, value in gen:             # no keepalive after the first: aborted in time
            outs.append(value)
        assert outs and outs[-1].finished and len(outs[-1].outputs[0].token_ids) < 1500
        assert w.report().owned == 0
        for _ in range(100):                    # the engine's stats follow its loop's next turn
            if w.report().kv_used == 0:
                break
            await asyncio.sleep(0.05)
        assert w.report().kv_used == 0
        # a live owner's request runs to the end
        await w.keepalive("gw-live")
        gen = w.generate("gw-live", ids, SamplingParams(max_tokens=20, ignore_eos=True), "r2", {})
        kinds = [k async for k, _ in gen]
        assert kinds[0] == "accepted" and kinds.count("out") >= 1
    finally:
        await w.shutdown()


async def test_a_worker_reports_the_prefixes_it_accepted_only_when_they_changed():
    """Its summary holds an accepted request's prefix chain (capped by its KV cache's blocks),
    and a report carries the keys only to a caller holding another version."""
    path = demo_model("llama", "tiny", 0)
    w = EngineWorker("w", {"a": path}, {"dtype": "float32", "num_kv_blocks": 64})
    await w.start()
    try:
        assert w.prefixes.capacity == 64
        first = w.report()
        assert first.prefixes == b"" and first.prefix_blocks == 0
        ids = random_prompts(path, [40], seed=2)[0]
        chain = prefix_chain("a\0t1\0", ids)
        await w.keepalive("gw")
        kinds = [k async for k, _ in w.generate("gw", ids, SamplingParams(max_tokens=2), "r1",
                                                   {"tenant": "t1"}, chain)]
        assert kinds[0] == "accepted"
        r = w.report(first.prefix_version)
        assert r.prefix_version != first.prefix_version and r.prefix_blocks == len(chain) == 2
        assert unpack_summary(r.prefixes) == {h[:8] for h in chain}
        assert w.report(r.prefix_version).prefixes is None        # unchanged: not sent again
    finally:
        await w.shutdown()


async def test_concurrent_starts_build_one_engine(monkeypatch):
    """Every replica starts a restarted worker at once: one engine is built, not one each."""
    from lockgate.engine import async_engine

    built = []
    real_start = async_engine.AsyncEngine.start

    async def counting_start(self):
        built.append(self)
        await real_start(self)

    monkeypatch.setattr(async_engine.AsyncEngine, "start", counting_start)
    w = EngineWorker("w", {"a": demo_model("llama", "tiny", 0)}, {"dtype": "float32", "num_kv_blocks": 32})
    try:
        reports = await asyncio.gather(w.start(), w.start(), w.start())
        assert len(built) == 1 and all(r.started for r in reports)
    finally:
        await w.shutdown()


class _Remote:
    """One method of a fake actor handle: `.remote(...)` records the call and returns an
    awaitable of `fn(...)` (which may raise, as a dead actor's call does)."""

    def __init__(self, calls: list, name: str, fn) -> None:
        self.calls, self.name, self.fn = calls, name, fn

    def remote(self, *args):
        self.calls.append((self.name, args))
        return _Ref(self.fn, args)


class _Ref:
    """An object ref: awaited (or not, as a fire-and-forget call), it runs the method then."""

    def __init__(self, fn, args) -> None:
        self.fn, self.args = fn, args

    def __await__(self):
        async def answer():
            return self.fn(*self.args)

        return answer().__await__()


class _FakeWorker:
    def __init__(self, name: str) -> None:
        self.name, self.calls, self.pid, self.started, self.reachable = name, [], 100, True, True
        for method in ("add_lora", "remove_lora", "set_tenant_weight", "keepalive", "abort"):
            setattr(self, method, _Remote(self.calls, method, lambda *a: None))
        self.report = _Remote(self.calls, "report", self._report)
        self.start = _Remote(self.calls, "start", self._start)

    def _report(self, *_):
        if not self.reachable:
            raise TimeoutError("no answer")
        from lockgate.engine.pool import WorkerReport

        return WorkerReport(worker_id=self.name, node="n", pid=self.pid, models={"a": True}, loras=[],
                            waiting={}, running={}, kv_used=0, kv_total=64, owned=0, capacity=1,
                            started=self.started, at=0.0, prefix_version=1, prefixes=b"")

    def _start(self, *_):
        self.started = True
        return self._report()


async def test_a_restarted_or_returning_worker_gets_the_pools_adapters_and_weights_again():
    """Adapters registered and tenant weights set through the pool reach a worker that Ray
    restarted (new pid, engine not started) and one that missed calls while unreachable,
    before either is routed to again."""
    from lockgate.engine.lora_files import LoRARequest
    from lockgate.engine.pool import Pool, PoolConfig

    pool = Pool(PoolConfig(address="auto", models={"a": "/m/a"}, engine_kwargs={}))
    workers = {n: _FakeWorker(n) for n in ("w0", "w1")}
    pool.names, pool.handles = list(workers), dict(workers)
    pool.failures = ()
    await pool.refresh()
    engine = pool.for_model("a")
    await engine.add_lora(LoRARequest("sql", 1, "/adapters/sql"))
    engine.set_tenant_weight("acme", 2.0)
    sent = {n: [c for c in w.calls if c[0] in ("add_lora", "set_tenant_weight")] for n, w in workers.items()}
    assert all(len(v) == 2 for v in sent.values())
    # w1 restarted by Ray: a new process whose engine is not started
    w1 = workers["w1"]
    w1.pid, w1.started = 200, False
    w1.calls.clear()
    await pool.refresh()
    assert "w1" in pool.down
    await asyncio.gather(*pool._restarting.values())
    assert "w1" not in pool.down and pool.restarts["w1"] == 1
    names = [c[0] for c in w1.calls]
    assert names.index("start") < names.index("add_lora")
    assert ("set_tenant_weight", ("acme", 2.0)) in w1.calls
    assert [c[1][0].lora_name for c in w1.calls if c[0] == "add_lora"] == ["sql"]
    # w0 unreachable for a round, then back: restored before it leaves `down`
    w0 = workers["w0"]
    w0.reachable = False
    await pool.refresh()
    assert "w0" in pool.down
    w0.reachable, w0.calls[:] = True, []
    engine.remove_lora("sql")                         # removed meanwhile: not sent again
    await pool.refresh()
    assert "w0" not in pool.down
    assert [c[0] for c in w0.calls if c[0] not in ("report", "remove_lora")] == ["set_tenant_weight"]


def test_pool_workers_counts_each_tensor_parallel_workers_devices():
    from lockgate.engine.pool.placement import DevicesShort, pool_workers

    assert pool_workers([4], 2, None) == 2               # two TP=2 groups on a node of four
    assert pool_workers([3, 2], 2, None) == 2            # the third device holds no group
    assert pool_workers([1, 1], 1, None) == 2
    assert pool_workers([4], 2, 1) == 1
    assert pool_workers([], 2, None) == 1                # no devices advertised: one worker
    with pytest.raises(DevicesShort, match=r"lends 2 lockgate_device unit\(s\) on 2 node\(s\) \(1, 1\); "
                                           r"1 worker\(s\) of tensor_parallel_size 2 need 2 on nodes of 2 "
                                           r"or more \(at most 0 worker\(s\) fit\)"):
        pool_workers([1, 1], 2, None)                    # a group never spans nodes
    with pytest.raises(DevicesShort, match=r"3 worker\(s\) of tensor_parallel_size 2 need 6"):
        pool_workers([4], 2, 3)


def test_a_tensor_parallel_worker_reports_its_size_and_devices_as_one_worker():
    w = EngineWorker("w", {"a": demo_model("llama", "tiny", 0)}, {"tensor_parallel_size": 2}, devices=2)
    r = w.report()
    assert (r.worker_id, r.tensor_parallel_size, r.devices) == ("w", 2, 2)
    assert EngineWorker("w", {"a": "x"}, {}).report().tensor_parallel_size == 1


def test_router_weighs_the_prefill_a_cache_saves_against_the_queue_in_seconds():
    """Both in seconds of each worker's own price: a worker holding the prefix wins while its
    queue costs less than the prefill it saves; an offline request pays more queue for it;
    precise cached tokens (the KV index) overrule the approximate record."""
    from lockgate.engine.pool.router import Price

    chain = prefix_chain("s", list(range(1024)))              # 64 blocks, 1,024 tokens
    prices = {"w0": Price(1e-4, 5e-3), "w1": Price(1e-4, 5e-3)}
    cached = {"w0": 1024, "w1": 0}.get
    # w0 saves 0.1024 s; each request queued costs 0.005 + 0.0512 s there
    # online: the queue weighs as much as the saving (its own TTFT); offline 0.5x, the saving 1.5x
    for ahead, online, offline in ((0, "w0", "w0"), (1, "w0", "w0"), (2, "w1", "w0"), (6, "w1", "w1")):
        load = {"w0": ahead, "w1": 0}
        for cls, want in (("online", online), ("offline", offline)):
            got, _ = Router().choose(["w0", "w1"], load.get, chain, cached=cached, prices=prices,
                                     inflight=lambda w: 0, service_class=cls, prompt_tokens=1024)
            assert got == want, (ahead, cls)
    # the approximate record says w1 (this replica sent it there long ago); the index says w0
    r = Router(recent_s=0.0)
    r.remember(chain, "w1")
    assert r.choose(["w0", "w1"], {"w0": 0, "w1": 0}.get, chain, cached=cached)[0] == "w0"
    # an index gone stale (None): the approximate record decides
    r = Router()
    r.remember(chain, "w1")
    assert r.choose(["w0", "w1"], {"w0": 0, "w1": 0}.get, chain, cached=lambda w: None)[0] == "w1"


def test_router_caps_how_far_one_worker_runs_ahead_of_the_least_loaded():
    r = Router()
    chain = prefix_chain("s", list(range(1024)))
    cached = {"w0": 1024, "w1": 0}.get
    free = {"w0": 0, "w1": 0}.get                       # the queue says nothing: the cap decides
    for inflight, want in ((3, "w0"), (4, "w1"), (7, "w0"), (8, "w1")):     # 2x + 3
        busy = {"w0": inflight, "w1": 0 if inflight < 7 else 2}
        assert r.choose(["w0", "w1"], free, chain, cached=cached, inflight=busy.__getitem__)[0] == want


def test_an_unfitted_cost_model_is_priced_as_the_fitted_ones():
    from lockgate.engine.pool.router import DEFAULT_PRICE, Price, price_of, priced_alike

    fitted = price_of({"const": 0.002, "prefill_tokens": 2e-4, "seqs": 1e-3, "prefill_attention": 0.0,
                       "sampled": 0.0, "decode_kv_tokens": 0.0}, 512)
    assert fitted == Price(token_s=2e-4, request_s=1e-3, step_s=0.002)
    assert priced_alike({"w0": fitted, "w1": None}) == {"w0": fitted, "w1": fitted}
    assert priced_alike({"w0": None, "w1": None}) == {"w0": DEFAULT_PRICE, "w1": DEFAULT_PRICE}


def test_pool_metrics_carry_each_workers_prefix_cache_and_the_index():
    from prometheus_client import generate_latest

    from lockgate.gateway.metrics import Metrics

    w = {"waiting": {}, "running": {}, "kv_used": 1, "kv_total": 4, "loras": [], "down": False,
         "restarts": 0, "prefix_cache_queries": 300, "prefix_cache_hits": 120,
         "kv_index": {"blocks": {"device": 7}, "fresh": True, "staleness_s": 0.25}}
    stale = {**w, "kv_index": {"blocks": {}, "fresh": False, "staleness_s": None},
             "kv_host": {"queries": 80, "hits": 48, "held": 3, "copy_ins": 3}}
    metrics = Metrics(lambda: [])
    metrics.watch_pool(lambda: {"workers": {"w0": w, "w1": stale}})
    text = generate_latest(metrics.registry).decode()
    assert 'vllm:prefix_cache_hits_total{tier="device",worker="w0"} 120.0' in text
    assert 'vllm:prefix_cache_queries_total{tier="device",worker="w0"} 300.0' in text
    assert 'lockgate_pool_kv_index_blocks{tier="device",worker="w0"} 7.0' in text
    assert 'lockgate_pool_kv_index_staleness_seconds{worker="w0"} 0.25' in text
    assert 'lockgate_pool_kv_index_staleness_seconds{worker="w1"} -1.0' in text
    # a worker with a host tier: its hits there apart from the device's (the engine's count is both)
    assert 'vllm:prefix_cache_hits_total{tier="device",worker="w1"} 72.0' in text
    assert 'vllm:prefix_cache_hits_total{tier="host",worker="w1"} 48.0' in text
    assert 'vllm:prefix_cache_queries_total{tier="host",worker="w1"} 80.0' in text


def test_bench_pool_skews_its_workload_and_averages_in_flight_over_time():
    from lockgate.loadtests.bench_pool import _inflight_ratio, _jobs

    systems = [[k] * 4 for k in range(4)]
    jobs = _jobs(systems, [[9]] * 100, 0.7)
    tenants = [t for t, _ in jobs]
    assert tenants.count("t0") == 70 and {tenants.count(f"t{k}") for k in (1, 2, 3)} <= {10, 11}
    assert all(ids == systems[int(t[1:])] + [9] for t, ids in jobs)
    assert [t for t, _ in _jobs(systems, [[9]] * 8, None)].count("t0") == 2
    # w0 busy 3 the whole time, w1 1 half of it: 3 / 0.5
    assert _inflight_ratio([{"w0": 3, "w1": 1}, {"w0": 3, "w1": 0}]) == 6.0
