"""Greedy output equals HF transformers' `generate`, token for token, on demo models: the
oracle for the model code, the paged cache, the scheduler and chunked prefill together."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.engine import LLM, AsyncEngine, SamplingParams
from lockgate.engine.request import EngineRequest
from tests.support.helpers import (
    FAMILIES,
    MAX_TOKENS,
    PROMPT_LENS,
    assert_all_blocks_free,
    demo_model,
    hf_greedy,
    random_prompts,
)


def run(llm: LLM, prompts, max_tokens):
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    return [o.outputs[0].token_ids for o in outs], outs


def expected(model_dir, prompts, max_tokens):
    return [hf_greedy(model_dir, p, m) for p, m in zip(prompts, max_tokens, strict=True)]


def num_matching(got, want) -> int:
    return sum(g == w for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf_each_family(family):
    """18 prompts of 1-300 tokens, mixed max_tokens, one generate call, block size 16."""
    d = demo_model(family)
    prompts = random_prompts(d, PROMPT_LENS, seed=1)
    want = expected(d, prompts, MAX_TOKENS)
    assert len({tuple(w) for w in want}) >= len(want) - 1, "demo model continuations should differ"
    llm = LLM(d)
    got, outs = run(llm, prompts, MAX_TOKENS)
    assert got == want
    for o, p in zip(outs, prompts, strict=True):
        assert o.prompt_token_ids == p
        assert o.outputs[0].finish_reason in ("stop", "length")
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 32},
        {"block_size": 8, "enable_prefix_caching": False},
        {"max_num_batched_tokens": 13},
        {"max_num_seqs": 3},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 512},
        {"scheduling_policy": "fcfs"},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_greedy_matches_hf_across_configs(kwargs):
    d = demo_model("llama")
    prompts = random_prompts(d, PROMPT_LENS, seed=2)
    llm = LLM(d, **kwargs)
    got, _ = run(llm, prompts, MAX_TOKENS)
    assert got == expected(d, prompts, MAX_TOKENS)
    if kwargs.get("max_num_batched_tokens") == 13:
        # every prompt over 13 tokens was split: at least sum(ceil(len / 13)) prefill steps
        assert llm.engine.timings.num_steps >= sum(-(-n // 13) for n in PROMPT_LENS) // 1
    assert_all_blocks_free(llm.engine)


def test_small_cache_queues_and_preempts_yet_matches():
    """22 blocks of 16 tokens hold 352 tokens: the longest request (300 + 30) fits alone,
    but the 18 requests together need ~2,600, so requests queue and running ones are
    preempted and recomputed; the tokens are the same."""
    d = demo_model("llama")
    prompts = random_prompts(d, PROMPT_LENS, seed=3)
    llm = LLM(d, num_kv_blocks=22)
    got, outs = run(llm, prompts, MAX_TOKENS)
    assert got == expected(d, prompts, MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_hits_and_matches(caching):
    """Second round: prompts that extend the first round's by a few tokens. With caching
    every full block of the old prompt is a hit; without, nothing is."""
    d = demo_model("llama")
    first = random_prompts(d, [40, 100, 170, 64], seed=4)
    extra = random_prompts(d, [5, 9, 3, 20], seed=5)
    second = [a + b for a, b in zip(first, extra, strict=True)]
    llm = LLM(d, enable_prefix_caching=caching)
    m1, m2 = [10, 6, 8, 12], [7, 11, 5, 9]
    got1, _ = run(llm, first, m1)
    got2, outs2 = run(llm, second, m2)
    assert got1 == expected(d, first, m1)
    assert got2 == expected(d, second, m2)
    cached = [o.num_cached_tokens for o in outs2]
    if caching:
        assert cached == [(len(p) // 16) * 16 for p in first]
        assert llm.engine.kv.num_cache_hits > 0
    else:
        assert cached == [0, 0, 0, 0]
    assert_all_blocks_free(llm.engine)


def test_async_engine_staggered_arrivals_match_hf():
    d = demo_model("qwen2")
    prompts = random_prompts(d, PROMPT_LENS, seed=6)
    want = expected(d, prompts, MAX_TOKENS)

    async def main():
        async with AsyncEngine(d, max_num_batched_tokens=64) as engine:
            async def one(i):
                await asyncio.sleep(0.015 * i)       # arrive while others decode
                final = None
                async for out in engine.generate({"prompt_token_ids": prompts[i]},
                                                 SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0),
                                                 f"r{i}"):
                    final = out
                return final.outputs[0].token_ids
            got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            core = engine.core
        return got, core

    got, core = asyncio.run(main())
    assert got == want
    assert_all_blocks_free(core)


@pytest.mark.parametrize("corruption", ["block_table", "positions"])
def test_corrupted_paging_breaks_the_match(corruption, monkeypatch):
    """The equivalence above is not vacuous: a wrong block table (each sequence's first two
    blocks swapped) or wrong positions (doubled) change most continuations of the demo
    model."""
    d = demo_model("llama")
    prompts = random_prompts(d, PROMPT_LENS, seed=7)
    llm = LLM(d, enable_prefix_caching=False)
    runner = llm.engine.runner
    real_prepare = runner.prepare

    def corrupt(sched, kv):
        inp = real_prepare(sched, kv)
        if corruption == "block_table":
            bt = inp.meta.block_tables
            if bt.shape[1] > 1:  # swap each sequence's first two blocks
                bt[:, [0, 1]] = bt[:, [1, 0]]
        else:
            # RoPE is relative: a constant shift changes nothing, so scale positions instead
            inp.positions.copy_(inp.positions * 2)
        return inp

    monkeypatch.setattr(runner, "prepare", corrupt)
    got, _ = run(llm, prompts, MAX_TOKENS)
    want = expected(d, prompts, MAX_TOKENS)
    longer = [i for i, n in enumerate(PROMPT_LENS) if n > 32]
    same = sum(got[i] == want[i] for i in longer)
    assert same <= len(longer) // 4, f"{same}/{len(longer)} still match with a corrupted {corruption}"


def _tenant_run(llm: LLM, x_prompts, y_prompt) -> dict[str, list[int]]:
    """x's requests fill every slot; after 3 steps y's request arrives (unless None). The
    finished requests' tokens, in the order they finished."""
    core = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(x_prompts):
        core.add_request(EngineRequest(f"x{i}", p, params, tenant="x"))
    for _ in range(3):
        core.step()
    if y_prompt is not None:
        core.add_request(EngineRequest("y", y_prompt, SamplingParams(max_tokens=3, temperature=0.0,
                                                                     ignore_eos=True), tenant="y"))
    done: dict[str, list[int]] = {}
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert_all_blocks_free(core)
    return done


def test_request_preempted_for_another_tenant_keeps_its_greedy_output():
    """2 slots, both held by tenant x's long greedy requests; tenant y's request arrives:
    x's newest is preempted so y gets a slot, and is recomputed later. y finishes while x's
    requests still run, and x's outputs are token for token those of a run without y (the
    preempted request's recomputation changes nothing)."""
    d = demo_model("llama")
    prompts = random_prompts(d, [20, 33, 9], seed=7)
    alone = _tenant_run(LLM(d, max_num_seqs=2, dtype="float32"), prompts[:2], None)
    llm = LLM(d, max_num_seqs=2, dtype="float32")
    done = _tenant_run(llm, prompts[:2], prompts[2])
    assert list(done) == ["y", "x0", "x1"]
    assert llm.engine.scheduler.num_preemptions == 1 and alone.keys() == {"x0", "x1"}
    assert (done["x0"], done["x1"]) == (alone["x0"], alone["x1"])
    assert [len(t) for t in done.values()] == [3, 40, 40]
