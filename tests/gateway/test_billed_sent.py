"""A stream that ends early bills the completion tokens the client received: a token whose
text the detokenizer held back (half a UTF-8 character, the start of a possible stop string)
was never sent, so neither its chunk nor the usage row counts it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from lockgate.engine import CompletionOutput, RequestOutput, SamplingParams
from lockgate.gateway.serving.chat import chat_chunks
from lockgate.gateway.serving.completion import completion_chunks
from lockgate.gateway.serving.job import RunInputs
from lockgate.gateway.serving.run import RequestRun

HEAD = {"id": "x", "created": 0, "model": "m", "service_tier": "default", "system_fingerprint": None}


def _run(prompts: int = 1) -> RequestRun:
    principal = SimpleNamespace(tenant_id="t1", tenant_name="acme", key_id="k1", weight=1, speculative=True)
    ticket = SimpleNamespace(principal=principal, state=SimpleNamespace(), id="r1", t0=0.0)
    inputs = RunInputs(prompts=[[1, 2, 3]] * prompts, params=[SamplingParams(max_tokens=8)] * prompts,
                       reserve_tokens=11 * prompts)
    run = RequestRun(ticket, SimpleNamespace(name="m"), "default", inputs)   # type: ignore[arg-type]
    run._tick = lambda i: None          # no metrics here
    return run


def _out(i: int, tokens: list[int], delta: str) -> RequestOutput:
    return RequestOutput(f"r1-{i}", None, [1, 2, 3],
                         [CompletionOutput(0, "", tokens, delta_text=delta)], finished=False)


def _feed(run: RequestRun, items: list[tuple]) -> None:
    run._open = len({i for _, i, _ in items})
    for item in items:
        run._queue.put_nowait(item)


async def _drain(gen) -> list[dict]:
    return [json.loads(b[len(b"data: "):]) async for b in gen]


def test_chat_stream_cut_bills_what_the_client_received() -> None:
    run = _run()
    run.continuous_usage = True
    _feed(run, [("out", 0, _out(0, [5, 6], "ab")), ("out", 0, _out(0, [5, 6, 7], "")),
                ("done", 0, None)])
    chunks = asyncio.run(_drain(chat_chunks(run, HEAD, 0, True, 1)))
    last_usage = chunks[-1]["usage"]["completion_tokens"]
    assert last_usage == 2
    assert run.counts("cancelled") == (3, 0, 2)     # the held-back third token went nowhere


def test_completion_stream_cut_bills_each_prompt_as_sent() -> None:
    run = _run(prompts=2)
    _feed(run, [("out", 0, _out(0, [5], "a")), ("out", 1, _out(1, [5, 6], "ab")),
                ("out", 1, _out(1, [5, 6, 7], "")), ("done", 0, None), ("done", 1, None)])
    asyncio.run(_drain(completion_chunks(run, HEAD, 0, False, 1)))
    assert run.counts("cancelled") == (6, 0, 3)
