"""Admission before expensive work, against the gateway in process (the fake engine) on both
backends: a request is counted against its tenant's request rate and takes its concurrency
lease before its body is read; its tokens are reserved once it is tokenized.

Before: the body was parsed and tokenized first, so a tenant on 5 requests/minute sent 33
1 MB prompts in 12 s, all answered 400 (too long) and none 429, each costing the event loop
half a second. Now the sixth is refused 429 before its body is read, a failed request (400)
keeps its rate count, and a refusal for lack of capacity does not count (tested in
test_gateway_overload.py).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")

GATEWAY_OPTIONS = {"max_body_bytes": 4 << 20}


async def post(gateway, key: str, body: bytes | dict, path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return await gateway.http.post(path, content=content,
                                   headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def big_chat(chars: int = 1_000_000) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "word " * (chars // 5)}],
            "max_tokens": 4}


async def test_the_rate_refuses_big_prompts_before_they_are_read(gateway):
    _, key = await gateway.tenant(quota={"requests_per_minute": 5})
    statuses = []
    for _ in range(8):
        r = await post(gateway, key, big_chat())
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert "requests_per_minute" in r.json()["error"]["message"]
        else:
            assert r.json()["error"]["code"] == "context_length_exceeded"
    # the five failed requests counted against the rate; the rest never reached the parser
    assert statuses == [400] * 5 + [429] * 3


async def test_a_body_that_cannot_be_parsed_is_refused_by_the_rate_first(gateway):
    _, key = await gateway.tenant(quota={"requests_per_minute": 1})
    assert (await post(gateway, key, b"{not json")).status_code == 400     # counted
    r = await post(gateway, key, b"{not json")
    assert r.status_code == 429, r.text                            # not parsed at all


async def test_concurrency_is_taken_before_the_body(gateway):
    _, key = await gateway.tenant(quota={"max_concurrent_requests": 1})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hold"}],
            "max_tokens": 2000, "ignore_eos": True, "stream": True}
    async with gateway.http.stream("POST", "/v1/chat/completions", json=body,
                                   headers=gateway.auth(key)) as held:
        assert held.status_code == 200
        lines = held.aiter_lines()
        assert (await anext(lines)).startswith("data: ")             # the stream runs
        r = await post(gateway, key, b"{not json")
        assert r.status_code == 429, r.text
        assert "max_concurrent_requests" in r.json()["error"]["message"]
    # the hold ended: the slot is free again
    ok = await post(gateway, key, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 1})
    assert ok.status_code == 200, ok.text


async def test_tokens_are_reserved_after_tokenizing_and_a_refusal_keeps_the_rate_count(gateway):
    _, key = await gateway.tenant(quota={"requests_per_minute": 2, "tokens_per_minute": 100})
    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = await post(gateway, key, {**small, "max_tokens": 200})              # reserves > 100 tokens
    assert r.status_code == 429
    assert "tokens_per_minute" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    ok = await post(gateway, key, small)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"      # the refused one counted
    third = await post(gateway, key, small)
    assert third.status_code == 429 and "requests_per_minute" in third.json()["error"]["message"]
    # the refused reservation holds nothing: the window has only the one that ran, reserved
    # as its prompt + max_tokens when its headers were made
    reserved = ok.json()["usage"]["prompt_tokens"] + 1
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) == 100 - reserved


async def test_big_prompts_of_one_tenant_do_not_stall_another(gateway):
    """Tenant A sends 200,000-character prompts (within its rate, and short enough in bytes
    that they might fit, so they are tokenized before their 400) while tenant B chats.
    Tokenizing one takes ~0.25 s of CPU, which on the event loop stalled every tenant (B's
    2-token chat took 12 s with 1 MB prompts); in the tokenizer's worker process it stalls no
    one. The bound is on latency because latency is the behaviour; it is generous (B alone
    answers in ~10 ms) and below what A's flood costs when run on the loop (its total below)."""
    _, key_a = await gateway.tenant()
    _, key_b = await gateway.tenant()
    a_statuses: list[int] = []

    async def flood() -> None:
        for _ in range(3):
            a_statuses.append((await post(gateway, key_a, big_chat(200_000))).status_code)

    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await post(gateway, key_b, small)).status_code == 200          # warm
    t0 = time.monotonic()
    floods = [asyncio.ensure_future(flood()) for _ in range(3)]
    b_latencies: list[float] = []
    while not all(f.done() for f in floods):
        t = time.monotonic()
        r = await post(gateway, key_b, small)
        assert r.status_code == 200, r.text
        b_latencies.append(time.monotonic() - t)
        await asyncio.sleep(0.05)
    await asyncio.gather(*floods)
    flood_s = time.monotonic() - t0
    assert a_statuses == [400] * 9                                   # too long, after tokenizing
    assert flood_s > 1.5, flood_s          # nine ~0.25 s tokenizations: seconds of work on the loop
    assert len(b_latencies) >= 5
    assert max(b_latencies) < 1.5, (max(b_latencies), flood_s)
