"""Bad input: a ValueError naming the field, raised before anything is queued; the engine
keeps serving everyone else."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.engine import LLM, AsyncEngine, EngineOverloaded, PromptTooLong, SamplingParams
from tests.support.helpers import assert_all_blocks_free, demo_model, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def llm():
    return LLM(demo_model("llama"), max_model_len=256, num_kv_blocks=12)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
    ],
)
def test_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, field",
    [
        ({"prompt_token_ids": []}, "prompt"),
        ("", "prompt"),
        ({"prompt_token_ids": [1, 2, 10**6]}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, -4]}, "prompt_token_ids"),
        ({"prompt_token_ids": [5] * 300}, "prompt"),          # over max_model_len 256
        (42, "prompt"),
    ],
)
def test_bad_prompts_raise_before_queueing(llm, prompt, field):
    good = random_prompts(demo_model("llama"), [20], seed=3)[0]
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        # the good prompt ahead of the bad one is not queued either
        llm.generate([{"prompt_token_ids": good}, prompt], SamplingParams(max_tokens=3),
                     use_progress_bar=False)
    assert not llm.engine.has_unfinished and llm.engine.kv.num_used_blocks == 0
    out = llm.generate([{"prompt_token_ids": good}], SamplingParams(max_tokens=4, temperature=0),
                       use_progress_bar=False)
    assert out[0].outputs[0].token_ids == hf_greedy(demo_model("llama"), good, 4)


def test_prompt_longer_than_the_whole_cache_fails_at_once():
    """12 blocks of 16 hold 192 tokens: a 200-token prompt can never run; it fails at once
    (not a hang), and says why."""
    llm = LLM(demo_model("llama"), num_kv_blocks=12)
    with pytest.raises(PromptTooLong, match="KV cache"):
        llm.generate([{"prompt_token_ids": [5] * 200}], SamplingParams(max_tokens=3), use_progress_bar=False)
    # a request that fits the cache but would outgrow it stops with "length" at the cache's end
    out = llm.generate([{"prompt_token_ids": [5] * 180}],
                       SamplingParams(max_tokens=100, ignore_eos=True), use_progress_bar=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 12
    assert_all_blocks_free(llm.engine)


def test_mismatched_sampling_params_list(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_progress_bar=False)


def test_bad_engine_config_names_the_field(tmp_path):
    d = demo_model("llama")
    for kwargs, field in [({"block_size": 12}, "block_size"), ({"dtype": "int8"}, "dtype"),
                          ({"scheduling_policy": "lifo"}, "scheduling_policy"),
                          ({"max_num_seqs": 0}, "max_num_seqs"), ({"num_kv_blocks": 0}, "num_kv_blocks"),
                          ({"max_model_len": 10**6}, "max_model_len")]:
        with pytest.raises(ValueError, match=field):
            LLM(d, **kwargs)
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"))


def test_async_engine_rejects_bad_input_and_overload():
    d = demo_model("llama")

    async def main():
        async with AsyncEngine(d, max_waiting_per_class=2, max_num_seqs=1) as engine:
            with pytest.raises(ValueError, match=r"^service_class"):
                async for _ in engine.generate("hi", SamplingParams(), "x", service_class="gold"):
                    pass
            with pytest.raises(ValueError, match=r"^max_tokens"):
                SamplingParams(max_tokens=-1)
            # one running (max_num_seqs=1), two waiting: the fourth is refused at once
            params = SamplingParams(max_tokens=60, ignore_eos=True)
            first = engine.generate("hello there", params, "r0")
            it = first.__aiter__()
            await it.__anext__()                       # r0 runs
            tasks = [asyncio.create_task(_drain(engine.generate("hello there", params, f"r{i}")))
                     for i in (1, 2)]
            for _ in range(200):
                if engine.stats().waiting["online"] == 2:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().waiting["online"] == 2
            with pytest.raises(EngineOverloaded):
                async for _ in engine.generate("one too many", params, "r3"):
                    pass
            done = [await _drain(it), *await asyncio.gather(*tasks)]
            assert [len(o.outputs[0].token_ids) for o in done] == [60, 60, 60]
            # and it keeps serving
            final = await _drain(engine.generate("after", SamplingParams(max_tokens=2), "r4"))
            assert final.finished
            return engine.core

    core = asyncio.run(main())
    assert_all_blocks_free(core)


async def _drain(stream):
    last = None
    async for out in stream:
        last = out
    return last


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda req: {"priority": "high"}, "priority"),
        (lambda req: {"tenant": 7}, "tenant"),
        (lambda req: {"cache_salt": b"x"}, "cache_salt"),
    ],
)
def test_request_fields_are_checked(llm, make, field):
    from lockgate.engine.request import EngineRequest

    req = EngineRequest("bad", [5, 6, 7], SamplingParams(), **make(None))
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        llm.engine.add_request(req)
    assert not llm.engine.has_unfinished


def test_sampling_params_checked_again_when_queued(llm):
    sp = SamplingParams(max_tokens=3)
    sp.n = 0                                   # changed after construction
    with pytest.raises(ValueError, match=r"^n\b"):
        llm.generate(["a"], sp, use_progress_bar=False)
    with pytest.raises(ValueError, match=r"^sampling_params"):
        llm.generate(["a", "b"], [SamplingParams(), None], use_progress_bar=False)
    for bad in ({"temperature": float("nan")}, {"repetition_penalty": float("inf")}):
        with pytest.raises(ValueError, match="finite"):
            SamplingParams(**bad)
    assert not llm.engine.has_unfinished


def test_abort_ends_the_stream_of_a_waiting_reader():
    d = demo_model("llama")

    async def main():
        async with AsyncEngine(d) as engine:
            stream = engine.generate("abc", SamplingParams(max_tokens=400, ignore_eos=True), "r1")
            it = stream.__aiter__()
            await it.__anext__()
            reader = asyncio.create_task(_drain(it))
            await asyncio.sleep(0.05)
            await engine.abort("r1")
            final = await asyncio.wait_for(reader, timeout=10)
            assert final.finished and final.outputs[0].finish_reason == "abort"
            # the id can be used again once the stream is over
            again = await _drain(engine.generate("abc", SamplingParams(max_tokens=2), "r1"))
            assert again.finished
            return engine.core

    assert_all_blocks_free(asyncio.run(main()))


def test_generate_after_shutdown_is_refused():
    from lockgate.engine import EngineDead

    async def main():
        engine = AsyncEngine(demo_model("llama"))
        await engine.start()
        await engine.shutdown()
        with pytest.raises(EngineDead):
            await _drain(engine.generate("abc", SamplingParams(max_tokens=2), "late"))

    asyncio.run(main())
