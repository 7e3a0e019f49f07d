"""Several base models on one memory budget (engine/model_pool.py): a budget that holds
one model at a time, interleaved online and offline requests for both, outputs equal HF
transformers, offloading and reloading happen, and the budget is never exceeded."""

from __future__ import annotations

import random

import pytest

from lockgate.engine import LLM, SamplingParams
from lockgate.engine.config import EngineConfig
from lockgate.engine.model_pool import ModelPool
from lockgate.engine.request import EngineRequest
from tests.support.helpers import demo_model, hf_greedy, random_prompts
from tests.support.quant import dequantize_checkpoint, run_quantize, write_hf_twin

NEW = 8


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs() -> dict[str, str]:
    return {"a": demo_model("llama", "tiny", 0), "b": demo_model("qwen2", "tiny", 1)}


def one_model_budget(dirs) -> tuple[int, dict[str, int]]:
    probe = ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, dtype="float32", num_kv_blocks=32))
    sizes = {n: s.memory_bytes for n, s in probe.stats().pool.models.items()}
    return max(sizes.values()) + min(sizes.values()) // 2, sizes


def test_two_models_that_do_not_fit_together_take_turns(dirs):
    budget, sizes = one_model_budget(dirs)
    assert budget < sum(sizes.values())
    pool = ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, dtype="float32",
                                  num_kv_blocks=32, memory_budget=budget, max_num_seqs=4))
    name_a = next(iter(pool.cores))
    assert pool.cores[name_a].resident and not pool.cores["b"].resident
    rng = random.Random(0)  # noqa: S311 - a seeded test workload, not a secret
    prompts = {"a": random_prompts(dirs["a"], [rng.randint(3, 40) for _ in range(10)], seed=1),
               "b": random_prompts(dirs["b"], [rng.randint(3, 40) for _ in range(10)], seed=2)}
    sent: dict[str, tuple[str, list[int]]] = {}
    done: dict[str, list[int]] = {}
    step = 0
    # interleave: a request of each model every few steps, online and offline alternating
    for i in range(10):
        for m in ("a", "b"):
            rid = f"{m}{i}"
            cls = "online" if (i + (m == "b")) % 2 else "offline"
            pool.add_request(EngineRequest(rid, prompts[m][i], greedy(), service_class=cls,
                                           model=None if m == "a" else "b"))
            sent[rid] = (m, prompts[m][i])
        for _ in range(3):
            for out in pool.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            assert pool.memory.used_bytes <= pool.memory.total_bytes
            resident = [n for n, c in pool.cores.items() if c.resident]
            assert len(resident) <= 1, resident
            step += 1
    while pool.has_unfinished:
        for out in pool.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        assert pool.memory.used_bytes <= pool.memory.total_bytes
    assert set(done) == set(sent), "every request completes: none lost or failed"
    for rid, (m, prompt) in sent.items():
        assert done[rid] == hf_greedy(dirs[m], prompt, NEW, ignore_eos=True), rid
    st = pool.stats()
    assert st.pool.models["b"].loads >= 2 and st.pool.models[name_a].offloads >= 2, st.pool.models
    assert st.pool.models[name_a].loads >= 2, "a came back after being offloaded"
    assert st.memory["peak_used_bytes"] <= budget
    assert sum(m.running + m.waiting for m in st.pool.models.values()) == 0
    for core in pool.cores.values():
        core.verify()
        assert core.kv.num_used_blocks == 0


def test_online_work_of_a_cold_model_goes_first(dirs):
    """Model a holds the device with offline work; an online request for b makes the pool
    switch at the next step, offloading a (its running offline requests preempted, not
    lost), and b's request finishes before a's offline ones."""
    budget, _ = one_model_budget(dirs)
    pool = ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, dtype="float32",
                                  num_kv_blocks=32, memory_budget=budget, min_turn_s=60.0))
    name_a = next(iter(pool.cores))
    for i, p in enumerate(random_prompts(dirs["a"], [20, 25, 30], seed=3)):
        pool.add_request(EngineRequest(f"off{i}", p, greedy(16), service_class="offline"))
    pool.step()
    pool.step()
    assert pool.current == name_a and pool.cores[name_a].scheduler.running
    online = random_prompts(dirs["b"], [12], seed=4)[0]
    pool.add_request(EngineRequest("on", online, greedy(), service_class="online", model="b"))
    order = []
    while pool.has_unfinished:
        order += [o.request_id for o in pool.step() if o.finished]
    assert order[0] == "on", order
    assert pool.stats().pool.models[name_a].offloads >= 1
    assert pool.cores[name_a].scheduler.num_preemptions >= 1
    assert sorted(order) == ["off0", "off1", "off2", "on"]


def test_llm_with_models_and_bad_configs(dirs):
    llm = LLM(dirs["a"], models={"b": dirs["b"]}, dtype="float32", num_kv_blocks=16)
    p = random_prompts(dirs["b"], [9], seed=5)[0]
    out = llm.generate({"prompt_token_ids": p}, greedy(), model="b")[0]
    assert out.outputs[0].token_ids == hf_greedy(dirs["b"], p, NEW, ignore_eos=True)
    from lockgate.engine import UnknownModel
    with pytest.raises(UnknownModel):
        llm.generate({"prompt_token_ids": p}, greedy(), model="c")
    with pytest.raises(ValueError, match="more than the whole budget"):
        ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, num_kv_blocks=16, memory_budget=1000))
    with pytest.raises(ValueError, match="is not a model directory"):
        EngineConfig(model=dirs["a"], models={"b": "/nonexistent"})


def test_a_quantized_and_a_full_precision_model_share_the_budget(dirs, tmp_path):
    """An AWQ model (made by `lockgate quantize`) and a float one on a one-model budget:
    both answer as HF does (the AWQ one as HF on its dequantized weights), taking turns."""
    quant = tmp_path / "awq"
    run_quantize(dirs["a"], str(quant), "--method", "awq", "--group-size", "32")
    twin = write_hf_twin(quant, tmp_path / "twin", dequantize_checkpoint(quant))
    probe = ModelPool(EngineConfig(model=str(quant), models={"b": dirs["b"]}, dtype="float32", num_kv_blocks=32))
    sizes = {n: m.memory_bytes for n, m in probe.stats().pool.models.items()}
    dense = one_model_budget(dirs)[1]
    assert sizes["awq"] < dense[next(iter(dense))], "the packed model takes less of the budget than its float original"
    pool = ModelPool(EngineConfig(model=str(quant), models={"b": dirs["b"]}, dtype="float32", num_kv_blocks=32,
                                  memory_budget=max(sizes.values()) + min(sizes.values()) // 2))
    prompts = random_prompts(dirs["a"], [11, 27, 5, 19], seed=6)
    for i, p in enumerate(prompts):
        pool.add_request(EngineRequest(f"r{i}", p, greedy(), model="b" if i % 2 else None))
    done = {}
    while pool.has_unfinished:
        done.update({o.request_id: o.outputs[0].token_ids for o in pool.step() if o.finished})
        assert pool.memory.used_bytes <= pool.memory.total_bytes
    for i, p in enumerate(prompts):
        oracle = dirs["b"] if i % 2 else str(twin)
        assert done[f"r{i}"] == hf_greedy(oracle, p, NEW, ignore_eos=True), i
    assert pool.stats().pool.models["b"].loads >= 1 and pool.stats().pool.models["awq"].offloads >= 1


def test_two_models_take_turns_on_one_budget_at_two_ranks(dirs):
    """Tensor parallelism changes nothing of the switching: each model's shards come and go on
    every rank (rank 0's budget counts its own shard), outputs equal HF's."""
    probe = ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, dtype="float32", num_kv_blocks=32,
                                   tensor_parallel_size=2))
    sizes = {n: s.memory_bytes for n, s in probe.stats().pool.models.items()}
    probe.shutdown()
    budget = max(sizes.values()) + min(sizes.values()) // 2
    pool = ModelPool(EngineConfig(model=dirs["a"], models={"b": dirs["b"]}, dtype="float32", num_kv_blocks=32,
                                  memory_budget=budget, max_num_seqs=4, tensor_parallel_size=2))
    try:
        rng = random.Random(3)  # noqa: S311 - a seeded test workload, not a secret
        prompts = {m: random_prompts(dirs[m], [rng.randint(3, 40) for _ in range(4)], seed=i + 1)
                   for i, m in enumerate("ab")}
        sent, done = {}, {}
        for i in range(4):
            for m in "ab":
                pool.add_request(EngineRequest(f"{m}{i}", prompts[m][i], greedy(), model=None if m == "a" else "b"))
                sent[f"{m}{i}"] = (m, prompts[m][i])
            for _ in range(3):
                done.update({o.request_id: o.outputs[0].token_ids for o in pool.step() if o.finished})
        while pool.has_unfinished:
            done.update({o.request_id: o.outputs[0].token_ids for o in pool.step() if o.finished})
        assert {r: done[r] for r in sent} == {r: hf_greedy(dirs[m], p, NEW, ignore_eos=True)
                                             for r, (m, p) in sent.items()}
        assert all(s.offloads >= 1 for s in pool.stats().pool.models.values())
        par = pool.stats().parallel
        assert par is not None and par.tensor_parallel_size == 2 and len(par.ranks) == 4   # a group per model
    finally:
        pool.shutdown()
