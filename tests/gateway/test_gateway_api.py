"""The official `openai` client against the gateway in process. Route behaviour (shapes,
streaming, errors, tiers, limits, usage rows, a client that leaves) on both backends,
SQLite + the in-process limiter and PostgreSQL + Redis, with the fake served engine; what
the model writes (HF's greedy tokens, logprobs, seeds, stop strings, the prefix cache, the
step-cost model) with the real engine on the tiny demo model."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import openai
import pytest
import pytest_asyncio

from lockgate.engine.cost_model import FEATURES
from lockgate.engine.tokenizer import Tokenizer
from tests.support.helpers import demo_model, hf_greedy

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODELS = {"tiny": demo_model("llama", "tiny", 0), "tiny-qwen": demo_model("qwen2", "tiny", 0)}
GATEWAY_OPTIONS = {"models": MODELS}
MODEL_GATEWAY_OPTIONS = {"models": MODELS}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model_tenant(model_gateway):
    return await model_gateway.tenant()


# -- what the model writes: the real engine --------------------------------------------------------
async def test_chat_matches_hf_greedy(model_gateway, model_tenant):
    """Greedy chat through HTTP gives HF transformers' tokens for the templated prompt."""
    _, key = model_tenant
    c = model_gateway.openai(key)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Tell me "},
                                             {"type": "text", "text": "about paging."}]}]
    r = await c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
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


async def test_chat_stream_with_usage_matches_non_stream(model_gateway, model_tenant):
    _, key = model_tenant
    c = model_gateway.openai(key)
    msgs = [{"role": "user", "content": "Stream this please"}]
    whole = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    chunks = [ch async for ch in await c.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True})]
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


async def test_completions_prompts_n_logprobs(model_gateway, model_tenant):
    _, key = model_tenant
    c = model_gateway.openai(key)
    r = await c.completions.create(model="tiny", prompt=["The cat", "A dog"], max_tokens=5, n=2,
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
    r2 = await c.completions.create(model="tiny", prompt=tok.encode("The cat"), max_tokens=5, temperature=0)
    assert r2.choices[0].text == r.choices[0].text


async def test_completions_stream(model_gateway, model_tenant):
    _, key = model_tenant
    c = model_gateway.openai(key)
    whole = await c.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=0)
    parts = [p async for p in await c.completions.create(
        model="tiny", prompt="Once upon", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})]
    assert "".join(p.choices[0].text for p in parts if p.choices) == whole.choices[0].text
    assert parts[-1].usage.completion_tokens == 8


async def test_chat_logprobs_and_seed(model_gateway, model_tenant):
    _, key = model_tenant
    c = model_gateway.openai(key)
    msgs = [{"role": "user", "content": "seeded"}]
    a = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=7, temperature=1.0,
                                        logprobs=True, top_logprobs=3)
    b = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, seed=7, temperature=1.0)
    assert a.choices[0].message.content == b.choices[0].message.content
    content = a.choices[0].logprobs.content
    assert len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token


async def test_stop_sequence(model_gateway, model_tenant):
    _, key = model_tenant
    c = model_gateway.openai(key)
    full = await c.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0)
    text = full.choices[0].text
    stop = text[3:5]
    assert stop
    r = await c.completions.create(model="tiny", prompt="stop test", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


async def test_engine_shows_its_fitted_step_cost_model(model_gateway, model_tenant):
    """The engine shows the step-cost model it sizes steps with, fitted from the steps it ran."""
    _, key = model_tenant
    await model_gateway.openai(key).completions.create(model="tiny", prompt="cost", max_tokens=4)
    cm = (await model_gateway.admin.get("/engine")).json()["models"]["tiny"]["cost_model"]
    assert cm["samples"] > 0 and set(cm["coefficients"]) == set(FEATURES)
    assert all(v >= 0 for v in cm["coefficients"].values()) and "prediction_error_median" in cm


# -- route behaviour: the fake engine, both backends -------------------------------------------------
async def test_raw_stream_ends_with_done(gateway, tenant):
    _, key = tenant
    async with gateway.http.stream("POST", "/v1/chat/completions", headers=gateway.auth(key),
                                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    for ln in lines[:-1]:
        json.loads(ln[6:])


async def test_models_lists_served_models(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    ids = sorted(m.id for m in (await c.models.list()).data)
    assert ids == ["tiny", "tiny-qwen"]
    assert (await c.models.retrieve("tiny")).id == "tiny"
    with pytest.raises(openai.NotFoundError):
        await c.models.retrieve("nope")


async def test_errors_as_openai_client_sees_them(gateway, tenant):
    _, key = tenant
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.AuthenticationError):
        await gateway.openai("lg-" + "x" * 43).chat.completions.create(model="tiny", messages=msgs)
    with pytest.raises(openai.AuthenticationError):
        await gateway.openai("not-a-key").models.list()
    c = gateway.openai(key)
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, extra_body={"functions": [{"name": "f"}]})
    assert e.value.body["param"] == "functions" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, logit_bias={"1": 500})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, extra_body={"bogus": 1})
    assert e.value.body["param"] == "bogus"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, n=100)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:
        await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}])
    assert e.value.body["param"].startswith("messages[0].content")
    with pytest.raises(openai.NotFoundError) as e:
        await c.chat.completions.create(model="gpt-4o", messages=msgs)
    assert e.value.code == "model_not_found"


async def test_raw_http_errors(gateway, tenant):
    _, key = tenant
    h = gateway.auth(key)
    url = "/v1/chat/completions"
    http = gateway.http
    r = await http.post(url, headers=h, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await http.post(url, headers=h, content=b"[1, 2]")
    assert r.status_code == 400
    r = await http.post(url, headers=h, content=b"x" * (2 << 20))
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = await http.post(url, headers={**h, "x-request-id": "my-trace-1"},
                        json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-trace-1"
    r = await http.get("/v1/nothing-here", headers=h)
    assert r.status_code == 404 and "error" in r.json() and r.headers["x-request-id"].startswith("req_")
    r = await http.post(url, headers=h, json={"model": "tiny", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = await http.post(url, headers=h, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                              "stream_options": {"include_usage": True}})
    assert r.status_code == 400


async def test_service_tiers(gateway):
    _, key = await gateway.tenant(service_tiers=["default", "flex"])
    c = gateway.openai(key)
    msgs = [{"role": "user", "content": "tier"}]
    r = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, service_tier="flex")
    assert r.service_tier == "flex"
    r = await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, service_tier="auto")
    assert r.service_tier == "default"
    with pytest.raises(openai.PermissionDeniedError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, service_tier="priority")
    assert e.value.body["param"] == "service_tier"
    # a flex-only tenant runs flex by default
    _, key2 = await gateway.tenant(service_tiers=["flex"], default_tier="flex")
    r = await gateway.openai(key2).chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
    assert r.service_tier == "flex"


async def test_rate_limit_error_and_headers(gateway):
    _, key = await gateway.tenant(quota={"requests_per_minute": 2})
    c = gateway.openai(key)
    msgs = [{"role": "user", "content": "limited"}]
    raw = await c.chat.completions.with_raw_response.create(model="tiny", messages=msgs, max_tokens=1)
    assert raw.headers["x-ratelimit-limit-requests"] == "2"
    assert raw.headers["x-ratelimit-remaining-requests"] == "1"
    await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        await c.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert e.value.code == "rate_limit_exceeded"
    h = e.value.response.headers
    assert 1 <= int(h["retry-after"]) <= 60
    assert h["x-ratelimit-remaining-requests"] == "0"


async def test_budget_is_insufficient_quota(gateway):
    _, key = await gateway.tenant(quota={"daily_token_budget": 40})
    c = gateway.openai(key)
    with pytest.raises(openai.RateLimitError) as e:
        await c.completions.create(model="tiny", prompt="a b c", max_tokens=64)
    assert e.value.code == "insufficient_quota"
    assert e.value.response.headers["x-should-retry"] == "false"


async def test_metrics_and_health(gateway, tenant):
    _, key = tenant
    await gateway.openai(key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "m"}],
                                                      max_tokens=2)
    text = (await gateway.admin.get(gateway.url + "/metrics")).text   # an admin key (or the metrics token)
    for name in ("lockgate_requests_total", "lockgate_time_to_first_token_seconds_bucket",
                 "lockgate_e2e_request_latency_seconds_bucket", "lockgate_tokens_total",
                 "lockgate_queue_depth", "lockgate_running", "lockgate_kv_blocks",
                 "lockgate_preemptions_total", "lockgate_time_per_output_token_seconds_bucket"):
        assert name in text, name
    assert (await gateway.http.get("/health")).json()["status"] == "ok"
    ready = (await gateway.http.get("/ready")).json()
    assert ready["status"] == "ready" and ready["database"] is True


async def test_usage_rows_and_reports(gateway):
    t, key = await gateway.tenant()
    c = gateway.openai(key)
    for i in range(3):
        await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"u{i}"}], max_tokens=4)
    await c.completions.create(model="tiny-qwen", prompt="q", max_tokens=2, extra_body={"service_tier": "flex"})
    r = await gateway.http.get("/v1/usage", params={"group_by": "model"}, headers=gateway.auth(key))
    assert r.status_code == 200, r.text
    groups = {g["group"]: g for g in r.json()["data"]}
    assert groups["tiny"]["requests"] == 3 and groups["tiny"]["completion_tokens"] == 12
    assert groups["tiny-qwen"]["requests"] == 1 and groups["tiny-qwen"]["completion_tokens"] == 2
    assert groups["tiny"]["ttft_ms_p50"] is not None
    r = await gateway.admin.get("/usage", params={"tenant_id": t["id"], "group_by": "service_tier"})
    tiers = {g["group"]: g["requests"] for g in r.json()["data"]}
    assert tiers == {"default": 3, "flex": 1}
    r = await gateway.admin.get("/usage", params={"tenant_id": t["id"], "format": "csv"})
    assert r.headers["content-type"].startswith("text/csv") and "requests" in r.text.splitlines()[0]


async def released(gateway) -> None:
    """Wait (10 s at most) until no request holds a lease, the KV cache is empty and the
    engine holds no request."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        eng = (await gateway.admin.get("/engine")).json()
        if (eng["inflight_requests"] == 0 and eng["models"]["tiny"]["kv_blocks"]["used"] == 0
                and all(e.open_requests == 0 for e in gateway.engines)):
            break
        await asyncio.sleep(0.05)
    assert eng["inflight_requests"] == 0 and eng["models"]["tiny"]["kv_blocks"]["used"] == 0
    assert [e.open_requests for e in gateway.engines] == [0] * len(gateway.engines)


@contextlib.contextmanager
def paced(gateway, seconds_per_token: float):
    """The fake engine takes this long a token: a long answer is still running when the
    client leaves."""
    before = [e.token_interval_s for e in gateway.engines]
    for e in gateway.engines:
        e.token_interval_s = seconds_per_token
    try:
        yield
    finally:
        for e, s in zip(gateway.engines, before, strict=True):
            e.token_interval_s = s


async def test_client_disconnect_aborts_and_releases(gateway):
    """A client that goes away mid-stream: the engine request is aborted (the engine holds
    nothing), the lease released, and one usage row says cancelled."""
    t, key = await gateway.tenant(quota={"max_concurrent_requests": 1})
    h = gateway.auth(key)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "long"}], "max_tokens": 1500,
            "stream": True, "ignore_eos": True}
    aborted = sum(e.num_aborted for e in gateway.engines)
    with paced(gateway, 0.01):
        async with gateway.http.stream("POST", "/v1/chat/completions", headers=h, json=body) as r:
            assert r.status_code == 200
            it = r.aiter_lines()
            await anext(it), await anext(it)     # a token arrived
        await released(gateway)
        assert sum(e.num_aborted for e in gateway.engines) == aborted + 1
        # non-streaming too: the client closes its connection while the request runs (seen
        # running in /admin/v1/engine, and no byte of an answer received yet)
        call = asyncio.ensure_future(gateway.http.post("/v1/chat/completions", headers=h,
                                                       json={**body, "stream": False, "max_tokens": 2000}))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if (await gateway.admin.get("/engine")).json()["inflight_requests"] == 1:
                break
            await asyncio.sleep(0.02)
        assert not call.done()                   # still running: nothing answered yet
        call.cancel()                            # the client leaves
        with pytest.raises(asyncio.CancelledError):
            await call
        await released(gateway)
        assert sum(e.num_aborted for e in gateway.engines) == aborted + 2
    # the concurrency lease is free again
    r = await gateway.openai(key).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=1)
    assert r.choices[0].finish_reason == "length"
    rows = (await gateway.admin.get("/usage", params={"tenant_id": t["id"]})).json()["data"]
    assert rows[0]["requests"] == 3 and rows[0]["cancelled"] == 2 and rows[0]["ok"] == 1
