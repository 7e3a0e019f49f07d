"""What a new user hit with the official clients against the gateway in process, on both
backends with the fake served engine, each fixed and kept so: a stream of `n` samples that
end at different steps says each one's finish_reason once (chat and completions)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
# sample 0 ends first, sample 2 last: the engine's outputs keep an ended sample, reason and all
SAMPLES = ["One.", "One, two.", "One, two, three, four."]


async def _events(gateway, key: str, route: str, body: dict) -> list[dict]:
    gateway.engine.answers[:] = [SAMPLES]
    async with gateway.http.stream("POST", route, headers=gateway.auth(key), json=body) as r:
        assert r.status_code == 200
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def _finishes(events: list[dict]) -> list[tuple[int, str]]:
    return [(c["index"], c["finish_reason"]) for e in events for c in e["choices"] if c["finish_reason"]]


def _texts(events: list[dict], field) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (field(c) or "")
    return texts


async def test_chat_stream_of_n_says_each_finish_reason_once(gateway, tenant):
    _, key = tenant
    events = await _events(gateway, key, "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "n": 3,
                            "max_tokens": 50, "stream": True})
    assert sorted(_finishes(events)) == [(0, "stop"), (1, "stop"), (2, "stop")]
    assert _texts(events, lambda c: c["delta"].get("content")) == dict(enumerate(SAMPLES))


async def test_completions_stream_of_n_says_each_finish_reason_once(gateway, tenant):
    _, key = tenant
    events = await _events(gateway, key, "/v1/completions",
                           {"model": MODEL, "prompt": "count", "n": 3, "max_tokens": 50, "stream": True})
    assert sorted(_finishes(events)) == [(0, "stop"), (1, "stop"), (2, "stop")]
    assert _texts(events, lambda c: c["text"]) == dict(enumerate(SAMPLES))
