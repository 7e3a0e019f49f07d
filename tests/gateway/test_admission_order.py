"""Admission before expensive work (issue 14, finding 2), against a live `lockgate serve` on
both backends: a request is counted against its tenant's request rate and takes its
concurrency lease before its body is read; its tokens are reserved once it is tokenized.

Before: the body was parsed and tokenized first, so a tenant on 5 requests/minute sent 33
1 MB prompts in 12 s, all answered 400 (too long) and none 429, each costing the event loop
half a second. Now the sixth is refused 429 before its body is read, a failed request (400)
keeps its rate count, and a refusal for lack of capacity does not count (tested in
test_gateway_overload.py).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model


@pytest.fixture(scope="module", params=["embedded", "services"])
def server(request, tmp_path_factory):
    models = {"tiny": demo_model("llama", "tiny", 0)}
    with running_server(tmp_path_factory.mktemp(request.param), request.param, models=models,
                        extra_env={"LOCKGATE_MAX_BODY_BYTES": str(4 << 20)}) as srv:
        yield srv


def post(server, key: str, body: bytes | dict, path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def big_chat(chars: int = 1_000_000) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "word " * (chars // 5)}],
            "max_tokens": 4}


def test_the_rate_refuses_big_prompts_before_they_are_read(server):
    _, key = server.tenant(quota={"requests_per_minute": 5})
    statuses = []
    for _ in range(8):
        r = post(server, key, big_chat())
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
            assert "requests_per_minute" in r.json()["error"]["message"]
        else:
            assert r.json()["error"]["code"] == "context_length_exceeded"
    # the five failed requests counted against the rate; the rest never reached the parser
    assert statuses == [400] * 5 + [429] * 3


def test_a_body_that_cannot_be_parsed_is_refused_by_the_rate_first(server):
    _, key = server.tenant(quota={"requests_per_minute": 1})
    assert post(server, key, b"{not json").status_code == 400     # counted
    r = post(server, key, b"{not json")
    assert r.status_code == 429, r.text                            # not parsed at all


def test_concurrency_is_taken_before_the_body(server):
    _, key = server.tenant(quota={"max_concurrent_requests": 1})
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as c:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hold"}],
                "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/chat/completions", json=body) as held:
            assert held.status_code == 200
            lines = held.iter_lines()       # kept: a dropped iterator closes the stream
            assert next(lines).startswith("data: ")                  # the stream runs
            r = post(server, key, b"{not json")
            assert r.status_code == 429, r.text
            assert "max_concurrent_requests" in r.json()["error"]["message"]
    # the hold ended: the slot is free again
    ok = post(server, key, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 1})
    assert ok.status_code == 200, ok.text


def test_tokens_are_reserved_after_tokenizing_and_a_refusal_keeps_the_rate_count(server):
    _, key = server.tenant(quota={"requests_per_minute": 2, "tokens_per_minute": 100})
    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(server, key, {**small, "max_tokens": 200})              # reserves > 100 tokens
    assert r.status_code == 429
    assert "tokens_per_minute" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    ok = post(server, key, small)
    assert ok.status_code == 200, ok.text
    assert ok.headers["x-ratelimit-remaining-requests"] == "0"      # the refused one counted
    third = post(server, key, small)
    assert third.status_code == 429 and "requests_per_minute" in third.json()["error"]["message"]
    # the refused reservation holds nothing: the window has only the one that ran, reserved
    # as its prompt + max_tokens when its headers were made
    reserved = ok.json()["usage"]["prompt_tokens"] + 1
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) == 100 - reserved


def test_big_prompts_of_one_tenant_do_not_stall_another(server):
    """Finding 2's measure: tenant A sends 1 MB prompts (within its rate) while tenant B chats.
    Tokenizing one such prompt takes ~1 s of CPU, which on the event loop stalled every tenant
    (B's 2-token chat took 12 s); in the tokenizer's worker process it stalls no one. The
    bound is on latency because latency is the behaviour; it is generous (B alone answers in
    ~10 ms) and far below what A's flood costs when run on the loop (its total below)."""
    import threading
    import time

    _, key_a = server.tenant()
    _, key_b = server.tenant()
    a_statuses: list[int] = []

    def flood() -> None:
        for _ in range(3):
            a_statuses.append(post(server, key_a, big_chat()).status_code)

    small = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(server, key_b, small).status_code == 200          # warm
    t0 = time.monotonic()
    threads = [threading.Thread(target=flood) for _ in range(3)]
    for t in threads:
        t.start()
    b_latencies: list[float] = []
    while any(t.is_alive() for t in threads):
        t = time.monotonic()
        r = post(server, key_b, small)
        assert r.status_code == 200, r.text
        b_latencies.append(time.monotonic() - t)
        time.sleep(0.05)
    for t in threads:
        t.join()
    flood_s = time.monotonic() - t0
    assert a_statuses == [400] * 9                                   # too long, after tokenizing
    assert flood_s > 3.0, flood_s          # nine ~1 s tokenizations: seconds of work on the loop
    assert len(b_latencies) >= 5
    assert max(b_latencies) < 1.5, (max(b_latencies), flood_s)
