"""vLLM's conventions, against the gateway in process with the real engine, configured as
vLLM's engine flags would (`lockgate serve` taking those flags: test_vllm_flags.py): its
metric names and types, a guarded /metrics, /tokenize and /detokenize, its sampling
extensions (stop_token_ids, skip_special_tokens, include_stop_str_in_output, priority,
continuous_usage_stats) and its adapter-loading routes; then the admin API's fixes from a new
user's list (public adapters by default, unknown model names refused, the audit log's
filters and cursor)."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from lockgate.engine.lora_demo import write_demo_adapter
from lockgate.engine.tokenizer import Tokenizer
from tests.support.helpers import demo_model, hf_greedy, random_prompts
from tests.support.inprocess_gateway import REAL_ENGINE_KWARGS, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
METRICS_TOKEN = "metrics-" + secrets.token_hex(16)
# what `--max-num-seqs 1 --max-model-len 512 --max-loras 2 --max-lora-rank 8
# --gpu-memory-utilization 0.5 --dtype float --block-size 16 --enable-prefix-caching` set
ENGINE_FLAGS = {"max_num_seqs": 1, "max_model_len": 512, "gpu_memory_utilization": 0.5, "dtype": "float32",
                "block_size": 16, "enable_prefix_caching": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    root = tmp / "adapters"
    root.mkdir()
    async with running_gateway(tmp / "data", engine="real", models={MODEL: demo_model("llama", "tiny", 0)},
                               engine_kwargs={**REAL_ENGINE_KWARGS, **ENGINE_FLAGS}, max_loras=2,
                               max_lora_rank=8, metrics_token=METRICS_TOKEN, adapter_root=root) as gw:
        gw.adapter_root = root
        yield gw


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenant(server):
    return await server.tenant()


def client(server, key) -> openai.AsyncOpenAI:
    return server.openai(key)


async def post(server, path: str, key: str | None, body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return await server.http.post(path, json=body, headers=headers)


async def scrape(server) -> dict[str, object]:
    """name -> metric family, read with the metrics token."""
    r = await server.http.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert r.status_code == 200, r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families, name: str, sample: str | None = None, **labels: str) -> float:
    """The one sample of family `name` (sample name `sample`) whose labels include `labels`."""
    family = families[name]
    found = [s.value for s in family.samples
             if s.name == (sample or name) and labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, sample, labels, family.samples)
    return found[0]


# -- metrics -----------------------------------------------------------------------------------------
async def test_metrics_need_an_admin_key_or_the_metrics_token(server, tenant):
    _, key = tenant
    url = "/metrics"
    assert (await server.http.get(url)).status_code == 401
    r = await server.http.get(url, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 403 and "LOCKGATE_METRICS_TOKEN" in r.json()["error"]["message"]
    assert (await server.http.get(url, headers={"Authorization": "Bearer " + METRICS_TOKEN[:-1] + "x"})
            ).status_code == 401
    for good in (METRICS_TOKEN, server.admin_key):
        r = await server.http.get(url, headers={"Authorization": f"Bearer {good}"})
        assert r.status_code == 200 and "lockgate_requests_total" in r.text


async def test_vllm_metrics_beside_lockgates_own(server, tenant):
    """The same streamed prompt twice (the second hits the prefix cache): vLLM's gauges,
    counters and histograms by model_name, with vLLM's types, and Lockgate's per-tenant
    series still there."""
    t, key = tenant
    prompt = random_prompts(demo_model("llama", "tiny", 0), [40], seed=11)[0]
    for _ in range(2):
        [_ async for _ in await client(server, key).completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, stream=True, extra_body={"ignore_eos": True})]
    m = await scrape(server)
    for name, kind in (("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries", "counter"),
                       ("vllm:prefix_cache_hits", "counter"), ("vllm:num_preemptions", "counter"),
                       ("vllm:lora_requests_info", "gauge"),
                       ("vllm:time_to_first_token_seconds", "histogram"),
                       ("vllm:inter_token_latency_seconds", "histogram"),
                       ("vllm:e2e_request_latency_seconds", "histogram"),
                       ("vllm:request_queue_time_seconds", "histogram")):
        assert m[name].type == kind, (name, m[name].type)
    assert 0.0 <= value(m, "vllm:kv_cache_usage_perc", model_name=MODEL) <= 1.0
    assert value(m, "vllm:num_requests_waiting", model_name=MODEL) == 0
    hits = value(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", model_name=MODEL, tier="device")
    queries = value(m, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total", model_name=MODEL,
                    tier="device")
    assert 32 <= hits < queries          # the second prompt's two full blocks, in tokens
    # the host KV tier, on by default: nothing was evicted, so it served nothing
    assert value(m, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total", model_name=MODEL, tier="host") == 0
    assert value(m, "lockgate_kv_tier_capacity_blocks", model_name=MODEL, tier="host") > 0
    assert value(m, "lockgate_kv_offload_copy_ins", "lockgate_kv_offload_copy_ins_total", model_name=MODEL) == 0
    tiers = (await server.admin.get("/engine")).json()["models"][MODEL]["kv_tiers"]
    assert tiers["device"]["hits"] == hits and tiers["host"]["capacity"] > 0 and tiers["host"]["copy_ins"] == 0
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert value(m, name, name + "_count", model_name=MODEL) >= 2, name
    # 6 tokens a request, streamed one a step: 5 gaps each
    assert value(m, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count",
                 model_name=MODEL) >= 10
    lora = value(m, "vllm:lora_requests_info", model_name=MODEL, max_lora="2",
                 running_lora_adapters="", waiting_lora_adapters="")
    assert lora > 1e9                    # a timestamp, as vLLM's
    assert value(m, "lockgate_requests", "lockgate_requests_total", tenant=t["name"], model=MODEL,
                 status="ok") == 2


def _counter(m, name: str, **labels: str) -> float:
    """A counter's value (0 before its first count), by the sample vLLM's scrapers read."""
    found = [s for s in m[name].samples if s.name == name + "_total" and labels.items() <= s.labels.items()]
    return value(m, name, name + "_total", **labels) if found else 0.0


async def test_vllm_token_and_success_counters(server, tenant):
    """vLLM's vllm:prompt_tokens_total, vllm:generation_tokens_total and
    vllm:request_success_total (by model_name, success also by finished_reason), counting
    what the usage says."""
    _, key = tenant
    c = client(server, key)
    names = ("vllm:prompt_tokens", "vllm:generation_tokens")
    before = await scrape(server)
    r1 = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                         max_tokens=5, extra_body={"ignore_eos": True})
    r2 = await c.completions.create(model=MODEL, prompt="one two", max_tokens=3, n=2,
                                    extra_body={"ignore_eos": True})
    after = await scrape(server)
    for name in (*names, "vllm:request_success"):
        assert after[name].type == "counter", name
    grew = {n: _counter(after, n, model_name=MODEL) - _counter(before, n, model_name=MODEL) for n in names}
    assert grew == {"vllm:prompt_tokens": r1.usage.prompt_tokens + r2.usage.prompt_tokens,
                    "vllm:generation_tokens": r1.usage.completion_tokens + r2.usage.completion_tokens}
    ok = [_counter(m, "vllm:request_success", model_name=MODEL, finished_reason="length") for m in (before, after)]
    assert ok[1] - ok[0] == 2


async def test_version_as_vllm(server):
    """`GET /version`, vLLM's shape, open as vLLM's is: the version `lockgate --version` prints."""
    import lockgate

    r = await server.http.get("/version")
    assert r.status_code == 200 and r.json() == {"version": lockgate.__version__}


async def test_error_answers_are_counted_with_status_and_code(server, tenant):
    _, key = tenant
    before = await scrape(server)

    def errors(m, status, code):
        fam = m["lockgate_http_errors"]
        return sum(s.value for s in fam.samples if s.name == "lockgate_http_errors_total"
                   and s.labels == {"status": status, "code": code})

    assert (await post(server, "/v1/chat/completions", "lg-" + "x" * 43, {})).status_code == 401
    assert (await post(server, "/v1/chat/completions", key, {"model": "nope", "messages": [
        {"role": "user", "content": "x"}]})).status_code == 404
    assert (await post(server, "/v1/completions", key, {"model": MODEL, "prompt": "x", "n": "two"})).status_code == 400
    assert (await server.admin.get("/tenants/ten_0000000000000000")).status_code == 404
    after = await scrape(server)
    for status, code in (("401", "invalid_api_key"), ("404", "model_not_found"), ("400", "invalid_value")):
        assert errors(after, status, code) == errors(before, status, code) + 1, (status, code)
    requests = {tuple(sorted(s.labels.items())): s.value for s in after["lockgate_http_requests"].samples
                if s.name == "lockgate_http_requests_total"}
    assert requests[(("method", "POST"), ("route", "/v1/chat/completions"), ("status", "404"))] >= 1
    assert requests[(("method", "POST"), ("route", "/v1/completions"), ("status", "200"))] >= 2
    # the route's template, its router's prefix included: no series per id
    assert requests[(("method", "GET"), ("route", "/admin/v1/tenants/{tenant_id}"), ("status", "404"))] == 1


# -- /tokenize and /detokenize ------------------------------------------------------------------------
async def test_tokenize_and_detokenize_as_vllm(server, tenant):
    _, key = tenant
    tok = Tokenizer(demo_model("llama", "tiny", 0))
    r = await post(server, "/tokenize", key, {"model": MODEL, "prompt": "Hello paging world",
                                              "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello paging world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and len(body["token_strs"]) == body["count"]
    r = await post(server, "/detokenize", key, {"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello paging world"}

    # a chat: exactly the prompt the chat route runs (its usage counts the same tokens)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi <|im_end|>"}]
    r = await post(server, "/tokenize", key, {"model": MODEL, "messages": messages})
    chat = await client(server, key).chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert r.json()["count"] == chat.usage.prompt_tokens

    for bad in ({"model": MODEL}, {"model": MODEL, "prompt": "a", "messages": messages},
                {"model": MODEL, "prompt": "a", "bogus": 1}):
        assert (await post(server, "/tokenize", key, bad)).status_code == 400, bad
    r = await post(server, "/detokenize", key, {"model": MODEL, "tokens": [1, 512]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    # the model's visibility, as for inference; tenant keys only
    _, locked = await server.tenant(models=[])
    assert (await post(server, "/tokenize", locked, {"model": MODEL, "prompt": "a"})).status_code == 404
    assert (await post(server, "/detokenize", locked, {"model": MODEL, "tokens": [5]})).status_code == 404
    assert (await post(server, "/tokenize", server.admin_key, {"model": MODEL, "prompt": "a"})).status_code == 403
    assert (await post(server, "/tokenize", None, {"model": MODEL, "prompt": "a"})).status_code == 401


# -- sampling extensions --------------------------------------------------------------------------------
async def test_stop_token_ids_and_include_stop_str_in_output(server, tenant):
    _, key = tenant
    path = demo_model("llama", "tiny", 0)
    tok = Tokenizer(path)
    prompt = random_prompts(path, [12], seed=5)[0]
    greedy = hf_greedy(path, prompt, 12, ignore_eos=True)
    k = next(i for i in range(3, 12) if greedy[i] not in greedy[:i])
    c = client(server, key)
    r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True, "stop_token_ids": [greedy[k]]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == tok.decode(greedy[:k])

    whole = tok.decode(greedy)
    stop = next(ch for ch in whole[3:] if ch.strip() and ch not in whole[:3])
    cut = whole.index(stop)
    r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                   extra_body={"ignore_eos": True})
    assert r.choices[0].text == whole[:cut]
    r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                   extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert r.choices[0].text == whole[:cut + 1]


async def test_skip_special_tokens(server, tenant):
    """The demo model seldom samples a special token, so the prompt is one (<|im_start|>)
    and repetition_penalty 0.01 multiplies the logits of the tokens seen (if positive): the
    greedy output then holds <|im_start|> among other tokens. Its text shows with
    skip_special_tokens false and is left out by default, the rest the same."""
    _, key = tenant
    kw = {"model": MODEL, "prompt": [1], "max_tokens": 8, "temperature": 0}
    body = {"ignore_eos": True, "repetition_penalty": 0.01}
    c = client(server, key)
    shown = (await c.completions.create(extra_body={**body, "skip_special_tokens": False}, **kw)).choices[0].text
    hidden = (await c.completions.create(extra_body=body, **kw)).choices[0].text
    assert "<|im_start|>" in shown and shown.replace("<|im_start|>", "").strip()
    assert hidden == shown.replace("<|im_start|>", "")


async def test_continuous_usage_stats(server, tenant):
    _, key = tenant
    chunks = [ch async for ch in await client(server, key).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})]
    assert all(ch.usage is not None for ch in chunks)
    completions = [ch.usage.completion_tokens for ch in chunks]
    assert completions == sorted(completions) and completions[0] == 0 and completions[-1] == 5
    assert len({ch.usage.prompt_tokens for ch in chunks}) == 1
    # without include_usage it would be silently meaningless: refused
    r = await post(server, "/v1/chat/completions", key, {
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
        "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 400 and "continuous_usage_stats" in r.json()["error"]["message"]


async def _stream_first_token(server, key: str, prompt: list[int], max_tokens: int, priority: int,
                              seen: dict[str, float], name: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "priority": priority}
    async with server.http.stream("POST", "/v1/completions", json=body, timeout=120,
                                  headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                seen.setdefault(name, time.monotonic())
    seen[name + ":end"] = time.monotonic()


async def test_priority_orders_a_tenants_own_requests_only(server):
    """One sequence slot (--max-num-seqs 1). A's long request holds it; then B sends x
    (priority 0), A sends y1 (priority 0), then y2 (priority -5, more urgent). When the slot
    frees, B goes first: A has had more service, and A's priority does not jump another
    tenant. Then A's own requests run by priority: y2 before its earlier y1."""
    _, key_a = await server.tenant()
    _, key_b = await server.tenant()
    prompts = random_prompts(demo_model("llama", "tiny", 0), [8, 8, 8, 8], seed=21)
    seen: dict[str, float] = {}
    tasks = []

    def start(key, prompt, max_tokens, priority, name):
        tasks.append(asyncio.ensure_future(
            _stream_first_token(server, key, prompt, max_tokens, priority, seen, name)))

    async def waiting() -> int:
        return sum((await server.admin.get("/engine")).json()["models"][MODEL]["waiting"].values())

    async def wait_for(n: int) -> None:
        deadline = time.monotonic() + 10
        while await waiting() < n:
            assert time.monotonic() < deadline, f"{n} requests never queued"
            await asyncio.sleep(0.01)

    start(key_a, prompts[0], 480, 0, "hold")
    while "hold" not in seen:
        await asyncio.sleep(0.01)
    start(key_b, prompts[1], 4, 0, "x")
    await wait_for(1)
    start(key_a, prompts[2], 4, 0, "y1")
    await wait_for(2)
    start(key_a, prompts[3], 4, -5, "y2")
    await wait_for(3)
    assert "hold:end" not in seen, "the long request ended before the others queued"
    await asyncio.wait_for(asyncio.gather(*tasks), 120)
    assert seen["x"] < seen["y2"] < seen["y1"], seen
    r = await post(server, "/v1/completions", key_a, {"model": MODEL, "prompt": "x", "priority": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


# -- adapters: vLLM's routes, and the admin route's defaults -------------------------------------------
@pytest.fixture(scope="module")
def adapter_dir(server, tmp_path_factory) -> str:
    src = write_demo_adapter(demo_model("llama", "tiny", 0), tmp_path_factory.mktemp("ada") / "a",
                             rank=4, targets="q,v", seed=3)
    shutil.copytree(src, server.adapter_root / "vl")
    return "vl"


async def test_vllm_lora_routes_load_and_unload(server, tenant, adapter_dir):
    _, key = tenant
    body = {"lora_name": "vllm-ada", "lora_path": str(server.adapter_root / adapter_dir)}
    r = await post(server, "/v1/load_lora_adapter", key, body)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_only"
    r = await post(server, "/v1/load_lora_adapter", server.admin_key, body)
    assert r.status_code == 200 and "vllm-ada" in r.text, r.text
    row = next(a for a in (await server.admin.get("/adapters")).json()["data"] if a["name"] == "vllm-ada")
    assert row["public"] and row["base_model"] == MODEL and row["path"] == adapter_dir
    out = await client(server, key).chat.completions.create(model="vllm-ada", max_tokens=2,
                                                            messages=[{"role": "user", "content": "hi"}])
    assert out.model == "vllm-ada"

    r = await post(server, "/v1/load_lora_adapter", server.admin_key,
                   {"lora_name": "elsewhere", "lora_path": "/tmp"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "lora_path"
    assert str(server.adapter_root.resolve()) in err["message"]       # says where the root is
    r = await post(server, "/v1/unload_lora_adapter", server.admin_key, {"lora_name": "vllm-ada"})
    assert r.status_code == 200, r.text
    assert "vllm-ada" not in {a["name"] for a in (await server.admin.get("/adapters")).json()["data"]}
    r = await post(server, "/v1/unload_lora_adapter", server.admin_key, {"lora_name": "vllm-ada"})
    assert r.status_code == 404


async def test_adapter_owner_is_optional_and_public(server, adapter_dir):
    r = await server.admin.post("/adapters", json={"name": "pub-default", "base_model": MODEL,
                                                   "path": adapter_dir})
    assert r.status_code == 201, r.text
    assert r.json()["public"] and r.json()["owner_tenant_id"] is None
    r = await server.admin.post("/adapters", json={"name": "out", "base_model": MODEL, "path": "../x"})
    assert r.status_code == 400 and str(server.adapter_root) in r.json()["error"]["message"]


# -- tenants' model lists ------------------------------------------------------------------------------
async def test_unknown_model_names_are_refused(server, adapter_dir):
    r = await server.admin.post("/tenants", json={"name": "t-" + secrets.token_hex(4), "models": ["tiny", "ghost"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "models"
    assert "'ghost'" in r.json()["error"]["message"]
    t, _ = await server.tenant()
    r = await server.admin.patch(f"/tenants/{t['id']}", json={"models": ["nonexistent"]})
    assert r.status_code == 400 and "'nonexistent'" in r.json()["error"]["message"]
    assert (await server.admin.get(f"/tenants/{t['id']}")).json()["models"] is None     # unchanged
    await server.admin.post("/adapters", json={"name": "named-ok", "base_model": MODEL, "path": adapter_dir})
    r = await server.admin.patch(f"/tenants/{t['id']}", json={"models": [MODEL, "named-ok"]})
    assert r.status_code == 200 and r.json()["models"] == [MODEL, "named-ok"]


# -- the audit log ----------------------------------------------------------------------------------------
async def test_audit_filters_cursor_and_unknown_parameters(server):
    t, _ = await server.tenant()
    for w in (2, 3, 4):
        assert (await server.admin.patch(f"/tenants/{t['id']}", json={"weight": w})).status_code == 200
    audit = server.admin
    r = await audit.get("/audit", params={"target_id": t["id"], "action": "tenant.update", "limit": 2})
    page = r.json()
    assert r.status_code == 200 and page["has_more"] and len(page["data"]) == 2
    assert all(e["target_id"] == t["id"] and e["action"] == "tenant.update" for e in page["data"])
    rest = (await audit.get("/audit", params={"target_id": t["id"], "action": "tenant.update",
                                              "after": page["last_id"]})).json()
    assert len(rest["data"]) == 1 and not rest["has_more"]
    ids = [e["id"] for e in page["data"] + rest["data"]]
    assert ids == sorted(ids, reverse=True) and len(set(ids)) == 3
    assert (await audit.get("/audit", params={"target_id": t["id"], "actor": "nobody"})).json()["data"] == []
    future = (await audit.get("/audit", params={"target_id": t["id"], "start": "2999-01-01T00:00:00Z"})).json()
    assert future["data"] == []
    everything = (await audit.get("/audit", params={"target_type": "tenant", "target_id": t["id"]})).json()["data"]
    assert {e["action"] for e in everything} == {"tenant.create", "tenant.update"}
    for bad in ({"tenant": t["id"]}, {"after": "abc"}, {"start": "yesterday"}, {"limit": 0}):
        r = await audit.get("/audit", params=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == next(iter(bad)), r.text


async def test_readme_lists_every_route(server):
    """Every route the app serves, method and path, is in the README's route table."""
    from lockgate.gateway.app import create_app
    from lockgate.gateway.settings import Settings
    from tests.gateway.test_gateway_security import _flatten

    def norm(path: str) -> str:
        return re.sub(r"\{[^}]*\}", "{}", path)

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    listed = {(m, norm(p)) for m, p in re.findall(r"`(GET|POST|PUT|PATCH|DELETE) (/[^`\s]*)`", readme)}
    app = create_app(Settings(data_dir=server.data_dir / "routes"))
    served = {(m, norm(p)) for p, methods, _ in _flatten(app.routes) for m in methods if m != "HEAD"}
    assert served - listed == set()


# -- error counting, without a server: the 5xx paths --------------------------------------------
async def test_count_responses_counts_5xx_and_unhandled_errors():
    """A 503 APIError is counted with its code; a route that raises past every handler is
    counted as the 500 the server answers; a 200 only in the request counts."""
    from types import SimpleNamespace

    from lockgate.gateway.errors import APIError
    from lockgate.gateway.metrics import CountResponses, Metrics

    metrics = Metrics(lambda: [])
    app_obj = SimpleNamespace(state=SimpleNamespace(lockgate=SimpleNamespace(metrics=metrics)))

    async def inner(scope, receive, send):
        if scope["path"] == "/busy":
            await APIError(503, "busy", code="engine_overloaded").response()(scope, receive, send)
        elif scope["path"] == "/boom":
            raise RuntimeError("boom")
        else:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    async def call(path: str) -> None:
        scope = {"type": "http", "method": "GET", "path": path, "headers": [], "app": app_obj}

        async def receive():
            return {"type": "http.request", "body": b""}

        async def send(message):
            pass

        await CountResponses(inner)(scope, receive, send)

    await call("/busy")
    await call("/")
    with pytest.raises(RuntimeError):
        await call("/boom")
    reg = metrics.registry
    assert reg.get_sample_value("lockgate_http_errors_total", {"status": "503", "code": "engine_overloaded"}) == 1
    assert reg.get_sample_value("lockgate_http_errors_total", {"status": "500", "code": "internal_error"}) == 1
    assert reg.get_sample_value("lockgate_http_requests_total",
                                {"method": "GET", "route": "unmatched", "status": "200"}) == 1
    assert reg.get_sample_value("lockgate_http_errors_total", {"status": "200", "code": ""}) is None
