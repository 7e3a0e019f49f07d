"""A request stream whose reader falls behind the engine: the outputs waiting for it come as
one, their deltas joined, an error after them still raised after them; and a real engine's
streams read late give the same text as streams read at every step."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.engine import AsyncEngine, EngineDead, SamplingParams
from lockgate.engine.client import RequestStream
from lockgate.engine.outputs import CompletionOutput, RequestOutput
from tests.support.helpers import demo_model


def _out(step: int, finished: bool = False) -> RequestOutput:
    ids = list(range(step + 1))
    return RequestOutput("r", None, [1, 2], finished=finished, outputs=[
        CompletionOutput(index=i, text="".join(f"{i}{t}" for t in ids), token_ids=ids,
                         finish_reason="length" if finished else None, delta_text=f"{i}{step}",
                         delta_token_ids=[step]) for i in range(2)])


def _stream() -> tuple[RequestStream, asyncio.Queue, list[str]]:
    queue: asyncio.Queue = asyncio.Queue()
    aborted: list[str] = []
    return RequestStream("r", queue, abort=aborted.append, forget=lambda _: None), queue, aborted


async def test_waiting_outputs_come_as_one_with_their_deltas_joined():
    stream, queue, aborted = _stream()
    queue.put_nowait(_out(0))
    first = await stream.__anext__()
    assert [c.delta_text for c in first.outputs] == ["00", "10"]
    for step in (1, 2, 3):
        queue.put_nowait(_out(step))
    late = await stream.__anext__()
    assert [c.delta_text for c in late.outputs] == ["010203", "111213"]
    assert [c.delta_token_ids for c in late.outputs] == [[1, 2, 3], [1, 2, 3]]
    assert late.outputs[0].token_ids == [0, 1, 2, 3]
    queue.put_nowait(_out(4, finished=True))
    queue.put_nowait(_out(5))          # nothing is read past the end
    end = await stream.__anext__()
    assert end.finished and [c.delta_text for c in end.outputs] == ["04", "14"]
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert aborted == []


async def test_an_error_behind_outputs_is_raised_after_them():
    stream, queue, aborted = _stream()
    queue.put_nowait(_out(0))
    queue.put_nowait(_out(1))
    queue.put_nowait(EngineDead("gone"))
    out = await stream.__anext__()
    assert [c.delta_text for c in out.outputs] == ["0001", "1011"]
    with pytest.raises(EngineDead):
        await stream.__anext__()
    assert aborted == ["r"]


async def test_a_late_reader_of_a_real_engine_reads_the_same_text():
    """Eight streams at once, half of them read only after a pause (the engine steps on
    meanwhile): every stream's joined deltas equal its final text and the prompt's greedy
    continuation, and the late readers got fewer, larger outputs."""
    engine = AsyncEngine(str(demo_model("llama", "tiny", 0)), dtype="float32", num_kv_blocks=256)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompt = [5, 6, 7, 8, 9, 10, 11, 12]

        async def read(k: int) -> tuple[str, str, int]:
            stream = engine.submit(prompt, params, f"s{k}")
            if k % 2:
                await asyncio.sleep(0.3)
            text, reads, last = "", 0, None
            async for out in stream:
                text += out.outputs[0].delta_text
                reads += 1
                last = out
            assert last is not None and last.finished
            return text, last.outputs[0].text, reads

        results = await asyncio.gather(*(read(k) for k in range(8)))
    finally:
        await engine.shutdown()
    assert len({final for _, final, _ in results}) == 1
    assert all(joined == final for joined, final, _ in results)
    prompt_reads = [reads for _, _, reads in results]
    assert max(prompt_reads[1::2]) < min(prompt_reads[0::2]) <= 24
