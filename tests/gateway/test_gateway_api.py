"""The official `openai` client against a live `lockgate serve` (real uvicorn, loopback port),
on both backends: SQLite + the in-process limiter, and PostgreSQL + Redis."""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest

from lockgate.engine.cost_model import FEATURES
from lockgate.engine.tokenizer import Tokenizer
from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model, hf_greedy


@pytest.fixture(scope="module", params=["embedded", "services"])
def server(request, tmp_path_factory):
    models = {"tiny": demo_model("llama", "tiny", 0), "tiny-qwen": demo_model("qwen2", "tiny", 0)}
    with running_server(tmp_path_factory.mktemp(request.param), request.param, models=models) as srv:
        yield srv


@pytest.fixture(scope="module")
def tenant(server):
    return server.tenant()


def client(server, key, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


def test_chat_matches_hf_greedy(server, tenant):
    """Greedy chat through HTTP gives HF transformers' tokens for the templated prompt."""
    _, key = tenant
    c = client(server, key)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                             {"type": "text", "text": "about paging."}]}]
    r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    path = demo_model("llama", "tiny", 0)
    tok = Tokenizer(path)
    ids = tok.encode(tok.apply_chat_template([{"role": "system", "content": "You are terse."},
                                              {"role": "user", "content": "Tell me about paging."}]),
                     add_special_tokens=False)
    expected = hf_greedy(path, ids, 12)
    assert r.choices[0].message.content == tok.decode(expected)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(ids) + 12
    assert r.service_tier == "default"
    assert r.model == "tiny"
    assert r.id.startswith("chatcmpl-")


def test_chat_stream_with_usage_matches_non_stream(server, tenant):
    _, key = tenant
    c = client(server, key)
    msgs = [{"role": "user", "content": "Stream this please"}]
    whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 10
    # the second identical prompt hit the prefix cache (same tenant)
    assert usage.prompt_tokens_details.cached_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_raw_stream_ends_with_done(server, tenant):
    _, key = tenant
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    for ln in lines[:-1]:
        json.loads(ln[6:])


def test_completions_prompts_n_logprobs(server, tenant):
    _, key = tenant
    c = client(server, key)
    r = c.completions.create(model="tiny", prompt=["The cat", "A dog"], max_tokens=5, n=2,
                             temperature=0, logprobs=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text            # greedy: same per prompt
    assert r.usage.completion_tokens == 20
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    # token-id prompts give the same text as the string
    tok = Tokenizer(demo_model("llama", "tiny", 0))
    r2 = c.completions.create(model="tiny", prompt=tok.encode("The cat"), max_tokens=5, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


def test_completions_stream(server, tenant):
    _, key = tenant
    c = client(server, key)
    whole = c.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    parts = list(c.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0,
                                      stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == 8


def test_chat_logprobs_and_seed(server, tenant):
    _, key = tenant
    c = client(server, key)
    msgs = [{"role": "user", "content": "seeded"}]
    a = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=7, temperature=1.0,
                                  logprobs=True, top_logprobs=3)
    b = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=7, temperature=1.0)
    assert a.choices[0].message.content == b.choices[0].message.content
    content = a.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token


def test_stop_sequence(server, tenant):
    _, key = tenant
    c = client(server, key)
    full = c.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[3:5]
    assert stop
    r = c.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_models_lists_served_models(server, tenant):
    _, key = tenant
    c = client(server, key)
    ids = sorted(m.id for m in c.models.list().data)
    assert ids == ["tiny", "tiny-qwen"]
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("nope")


def test_errors_as_openai_client_sees_them(server, tenant):
    _, key = tenant
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.AuthenticationError):
        client(server, "lg-" + "x" * 43).chat.completions.create(model="tiny", messages=msgs)
    with pytest.raises(openai.AuthenticationError):
        client(server, "not-a-key").models.list()
    c = client(server, key)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, extra_body={"functions": [{"name": "f"}]})
    assert e.value.body["param"] == "functions" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, logit_bias={"1": 5})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, extra_body={"bogus": 1})
    assert e.value.body["param"] == "bogus"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, n=100)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert e.value.body["param"].startswith("messages[0].content")
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=msgs)
    assert e.value.code == "model_not_found"


def test_raw_http_errors(server, tenant):
    _, key = tenant
    h = {"Authorization": f"Bearer {key}"}
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, headers=h, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url, headers=h, content=b"[1, 2]")
    assert r.status_code == 400
    r = httpx.post(url, headers=h, content=b"x" * (2 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(url, headers={**h, "x-request-id": "my-trace-1"},
                   json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-trace-1"
    r = httpx.get(server.url + "/v1/nothing-here", headers=h)
    assert r.status_code == 404 and "error" in r.json() and r.headers["x-request-id"].startswith("req_")
    r = httpx.post(url, headers=h, json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url, headers=h, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 400


def test_service_tiers(server):
    _, key = server.tenant(service_tiers=["default", "flex"])
    c = client(server, key)
    msgs = [{"role": "user", "content": "tier"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, service_tier="flex")
    assert r.service_tier == "flex"
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, service_tier="auto")
    assert r.service_tier == "default"
    with pytest.raises(openai.PermissionDeniedError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, service_tier="priority")
    assert e.value.body["param"] == "service_tier"
    # a flex-only tenant runs flex by default
    _, key2 = server.tenant(service_tiers=["flex"], default_tier="flex")
    r = client(server, key2).chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    assert r.service_tier == "flex"


def test_rate_limit_error_and_headers(server):
    _, key = server.tenant(quota={"requests_per_minute": 2})
    c = client(server, key)
    msgs = [{"role": "user", "content": "limited"}]
    raw = c.chat.completions.with_raw_response.create(model="tiny", messages=msgs, max_tokens=1)
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert e.value.code == "rate_limit_exceeded"
    h = e.value.response.headers
    assert 1 <= int(h["retry-after"]) <= 60
    assert h["x-ratelimit-remaining-requests"] == "0"


def test_budget_is_insufficient_quota(server):
    _, key = server.tenant(quota={"daily_token_budget": 40})
    c = client(server, key)
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model="tiny", prompt="a b c", max_tokens=64)
    assert e.value.code == "insufficient_quota"
    assert e.value.response.headers["x-should-retry"] == "false"


def test_metrics_and_health(server, tenant):
    _, key = tenant
    client(server, key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "m"}],
                                                 max_tokens=2)
    text = server.admin.get(server.url + "/metrics").text     # an admin key (or the metrics token)
    for name in ("lockgate_requests_total", "lockgate_time_to_first_token_seconds_bucket",
                 "lockgate_e2e_request_latency_seconds_bucket", "lockgate_tokens_total",
                 "lockgate_queue_depth", "lockgate_running", "lockgate_kv_blocks",
                 "lockgate_preemptions_total", "lockgate_time_per_output_token_seconds_bucket"):
        assert name in text, name
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    ready = httpx.get(server.url + "/ready").json()
    assert ready["status"] == "ready" and ready["database"] is True


def test_usage_rows_and_reports(server):
    t, key = server.tenant()
    c = client(server, key)
    for i in range(3):
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"u{i}"}], max_tokens=4)
    c.completions.create(model="tiny-qwen", prompt="q", max_tokens=2, extra_body={"service_tier": "flex"})
    r = httpx.get(server.url + "/v1/usage", params={"group_by": "model"},
                  headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    groups = {g["group"]: g for g in r.json()["data"]}
    assert groups["tiny"]["requests"] == 3 and groups["tiny"]["completion_tokens"] == 12
    assert groups["tiny-qwen"]["requests"] == 1 and groups["tiny-qwen"]["completion_tokens"] == 2
    assert groups["tiny"]["ttft_ms_p50"] is not None
    r = server.admin.get("/usage", params={"tenant_id": t["id"], "group_by": "service_tier"})
    tiers = {g["group"]: g["requests"] for g in r.json()["data"]}
    assert tiers == {"default": 3, "flex": 1}
    # the engine shows the step-cost model it sizes steps with, fitted from the steps it ran
    cm = server.admin.get("/engine").json()["models"]["tiny"]["cost_model"]
    assert cm["samples"] > 0 and set(cm["coefficients"]) == set(FEATURES)
    assert all(v >= 0 for v in cm["coefficients"].values()) and "prediction_error_median" in cm
    r = server.admin.get("/usage", params={"tenant_id": t["id"], "format": "csv"})
    assert r.headers["content-type"].startswith("text/csv") and "requests" in r.text.splitlines()[0]


def released(server) -> None:
    """Wait (10 s at most) until no request holds a lease and the KV cache is empty."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        eng = server.admin.get("/engine").json()
        if eng["inflight_requests"] == 0 and eng["models"]["tiny"]["kv_blocks"]["used"] == 0:
            break
        time.sleep(0.05)
    assert eng["inflight_requests"] == 0 and eng["models"]["tiny"]["kv_blocks"]["used"] == 0


def test_client_disconnect_aborts_and_releases(server):
    """A client that goes away mid-stream: the engine request is aborted (KV freed), the lease
    released, and one usage row says cancelled."""
    t, key = server.tenant(quota={"max_concurrent_requests": 1})
    h = {"Authorization": f"Bearer {key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "long"}], "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", headers=h, json=body, timeout=60) as r:
        assert r.status_code == 200
        it = r.iter_lines()
        next(it), next(it)     # a token arrived
    released(server)
    # non-streaming too: the client closes its connection while the request runs (seen
    # running in /admin/v1/engine, and no byte of an answer received yet)
    payload = json.dumps({**body, "stream": False, "max_tokens": 2000}).encode()
    url = httpx.URL(server.url)
    with socket.create_connection((url.host, url.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: lockgate\r\n"
                     + f"Authorization: Bearer {key}\r\n".encode()
                     + b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if server.admin.get("/engine").json()["inflight_requests"] == 1:
                break
            time.sleep(0.02)
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):     # still running: nothing answered yet
            sock.recv(1)
    released(server)
    # the concurrency lease is free again
    r = client(server, key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                    max_tokens=1)
    assert r.choices[0].finish_reason == "length"
    rows = server.admin.get("/usage", params={"tenant_id": t["id"]}).json()["data"]
    assert rows[0]["requests"] == 3 and rows[0]["cancelled"] == 2 and rows[0]["ok"] == 1
