"""AsyncEngine: streaming, joining a running batch, abort, stats."""

from __future__ import annotations

import asyncio

from lockgate.engine import AsyncEngine, SamplingParams
from tests.support.helpers import assert_all_blocks_free, demo_model, random_prompts


async def collect(stream):
    outs = []
    async for out in stream:
        outs.append(out)
    return outs


def test_stream_deltas_add_up_and_never_split_characters():
    d = demo_model("llama")
    # multi-byte characters: byte-level tokens that only make a character together
    prompt = "naïve café 日本語 🎉🎉 " * 3

    async def main():
        async with AsyncEngine(d) as engine:
            outs = await collect(engine.generate(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=1), "s1"))
            return engine, outs

    engine, outs = asyncio.run(main())
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1])
    c = final.outputs[0]
    assert "".join(o.outputs[0].delta_text for o in outs) == c.text
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == c.token_ids
    assert c.text == engine.tokenizer.decode(c.token_ids)
    # each output carries all tokens so far
    assert [len(o.outputs[0].token_ids) for o in outs] == sorted(len(o.outputs[0].token_ids) for o in outs)
    assert final.metrics.first_token_time >= final.metrics.first_scheduled_time >= final.metrics.arrival_time


def test_decode_stream_holds_back_partial_characters():
    from lockgate.engine.tokenizer import Tokenizer

    tok = Tokenizer(demo_model("llama"))
    text = "héllo 日本 🎉 done"
    ids = tok.encode(text)
    stream = tok.decode_stream()
    deltas = [tok.step_stream(stream, t) for t in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert len(ids) > len(deltas) - deltas.count("")   # some tokens completed no character


def test_late_request_joins_the_running_batch_and_abort_frees_blocks():
    d = demo_model("llama")
    long_prompt, short_prompt = random_prompts(d, [50, 10], seed=21)

    async def main():
        async with AsyncEngine(d) as engine:
            first = engine.generate({"prompt_token_ids": long_prompt},
                                    SamplingParams(max_tokens=400, ignore_eos=True), "long", tenant="a")
            it = first.__aiter__()
            out = await it.__anext__()
            while len(out.outputs[0].token_ids) < 5:
                out = await it.__anext__()
            stats = engine.stats()
            assert stats.running["online"] == 1 and stats.running_by_tenant == {"a": 1}
            late = await collect(engine.generate({"prompt_token_ids": short_prompt},
                                                 SamplingParams(max_tokens=3), "late", service_class="offline"))
            # the late request finished while the long one was still decoding
            out = await it.__anext__()
            assert not out.finished and late[-1].finished
            assert engine.core.kv.num_used_blocks > 0
            await engine.abort("long")
            for _ in range(100):
                if engine.stats().kv.used == 0:
                    break
                await asyncio.sleep(0.02)
            assert engine.stats().kv.used == 0
            await first.aclose()
            return engine.core

    core = asyncio.run(main())
    assert_all_blocks_free(core)


def test_consumer_going_away_aborts_the_request():
    d = demo_model("llama")

    async def main():
        async with AsyncEngine(d) as engine:
            async for out in engine.generate("abc", SamplingParams(max_tokens=500, ignore_eos=True), "gone"):
                if len(out.outputs[0].token_ids) >= 3:
                    break   # the async generator is closed: the engine aborts the request
            for _ in range(100):
                s = engine.stats()
                if s.kv.used == 0 and s.num_requests == 0:
                    break
                await asyncio.sleep(0.02)
            assert s.kv.used == 0 and s.num_requests == 0
            assert s.num_generated_tokens < 500
            return engine.core

    assert_all_blocks_free(asyncio.run(main()))
