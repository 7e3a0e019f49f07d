"""Speculative decoding served: the real engine on the copy demo model (its greedy output
quotes the prompt) with `speculative_config`, in process, one gateway for the module. vLLM's
`spec_decode` counters on /metrics per service class, and /admin/v1/engine's acceptance and
switch per class, after a quoting request (whole, then streamed: the same text); a tenant
plan's `speculative` through the admin API, and a request of a plan without it."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from lockgate.engine.demo_tokenizer import _corpus
from lockgate.engine.tokenizer import Tokenizer
from tests.support.helpers import copy_model
from tests.support.inprocess_gateway import REAL_ENGINE_KWARGS, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory):
    async with running_gateway(tmp_path_factory.mktemp("spec"), engine="real", models={"copy": copy_model()},
                               engine_kwargs={**REAL_ENGINE_KWARGS, "speculative_config": SPEC}) as g:
        yield g


def quoting_body() -> dict:
    src = Tokenizer(copy_model()).encode(" ".join(_corpus()[:4]))
    return {"model": "copy", "prompt": src + src[:6], "max_tokens": 32, "temperature": 0, "ignore_eos": True}


def spec_samples(metrics: str) -> dict[tuple[str, str | None, str | None], float]:
    """(name, service_class, position) -> value, of the copy model's spec_decode series."""
    return {(s.name, s.labels.get("service_class"), s.labels.get("position")): s.value
            for f in text_string_to_metric_families(metrics)
            if f.name.startswith(("vllm:spec_decode", "lockgate_spec_decode"))
            for s in f.samples if "copy" in (s.labels.get("model_name"), s.labels.get("model"))}


async def test_spec_counters_on_metrics_and_admin_engine(gw):
    _, key = await gw.tenant()
    body = quoting_body()
    r = await gw.http.post("/v1/completions", headers=gw.auth(key), json=body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text
    # streamed, several tokens a step: the same text in its chunks
    chunks = []
    async with gw.http.stream("POST", "/v1/completions", headers=gw.auth(key), json={**body, "stream": True}) as s:
        async for line in s.aiter_lines():
            if line.startswith("data: {"):
                chunks += [c["text"] for c in json.loads(line[6:])["choices"]]
    assert "".join(chunks) == text
    engine = (await gw.admin.get("/engine")).json()["models"]["copy"]
    samples = spec_samples((await gw.admin.get(gw.url + "/metrics")).text)
    spec = engine["speculative"]
    online = spec["classes"]["online"]
    assert spec["num_speculative_tokens"] == 4 and online["enabled"] is True
    assert online["num_accepted_tokens"] > 0 and 0 < online["acceptance_rate"] <= 1
    assert spec["num_drafts"] == online["num_drafts"] and len(spec["accepted_per_pos"]) == 4
    assert samples[("vllm:spec_decode_num_drafts_total", "online", None)] == online["num_drafts"]
    assert samples[("vllm:spec_decode_num_draft_tokens_total", "online", None)] == online["num_draft_tokens"]
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", "online", None)] == online["num_accepted_tokens"]
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "online", str(i))] for i in range(4)]
    assert per_pos == online["accepted_per_pos"] and sum(per_pos) == online["num_accepted_tokens"]
    # every class has its series; the offline class (flex) ran nothing yet
    assert samples[("vllm:spec_decode_num_drafts_total", "offline", None)] == 0
    assert samples[("lockgate_spec_decode_enabled", "online", None)] == 1.0


async def test_a_tenant_plan_without_speculation(gw):
    """`speculative` on a tenant: created false, shown, refused when not a boolean (400 naming
    it), changed by PATCH; a request of the plan without it drafts nothing (the counters stay
    put) and gives the same text as one of a plan with it, whose request drafts."""
    t, key = await gw.tenant(speculative=False)
    assert t["speculative"] is False
    assert (await gw.admin.get(f"/tenants/{t['id']}")).json()["speculative"] is False
    for bad in ("no", None, 0):
        r = await gw.admin.patch(f"/tenants/{t['id']}", json={"speculative": bad})
        assert r.status_code == 400 and "speculative" in r.text, r.text
    r = await gw.admin.post("/tenants", json={"name": "spec-bad", "speculative": "yes"})
    assert r.status_code == 400 and "speculative" in r.text, r.text
    on, on_key = await gw.tenant()
    assert on["speculative"] is True

    async def run(k: str) -> tuple[str, float]:
        before = spec_samples((await gw.admin.get(gw.url + "/metrics")).text)
        r = await gw.http.post("/v1/completions", headers=gw.auth(k), json={**quoting_body(), "speculative": True})
        assert r.status_code == 200, r.text
        after = spec_samples((await gw.admin.get(gw.url + "/metrics")).text)
        name = ("vllm:spec_decode_num_draft_tokens_total", "online", None)
        return r.json()["choices"][0]["text"], after[name] - before[name]

    off_text, off_drafts = await run(key)
    on_text, on_drafts = await run(on_key)
    assert off_drafts == 0 and on_drafts > 0 and off_text == on_text
    r = await gw.admin.patch(f"/tenants/{t['id']}", json={"speculative": True})
    assert r.status_code == 200 and r.json()["speculative"] is True
    _, drafts = await run(key)
    assert drafts > 0
