"""Speculative decoding served: the real engine on the copy demo model (its greedy output
quotes the prompt) with `speculative_config`, in process. vLLM's `spec_decode` counters on
/metrics, and /admin/v1/engine's acceptance and switch per class, after a quoting request
(whole, then streamed: the same text)."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lockgate.engine.demo_tokenizer import _corpus
from lockgate.engine.tokenizer import Tokenizer
from tests.support.helpers import copy_model
from tests.support.inprocess_gateway import REAL_ENGINE_KWARGS, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


async def test_spec_counters_on_metrics_and_admin_engine(tmp_path):
    model = copy_model()
    src = Tokenizer(model).encode(" ".join(_corpus()[:4]))
    async with running_gateway(tmp_path, engine="real", models={"copy": model},
                               engine_kwargs={**REAL_ENGINE_KWARGS, "speculative_config": SPEC}) as gw:
        _, key = await gw.tenant()
        body = {"model": "copy", "prompt": src + src[:6], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
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
        metrics = (await gw.admin.get(gw.url + "/metrics")).text
    spec = engine["speculative"]
    online = spec["classes"]["online"]
    assert spec["num_speculative_tokens"] == 4 and online["enabled"] is True
    assert online["num_accepted_tokens"] > 0 and 0 < online["acceptance_rate"] <= 1
    assert spec["num_drafts"] == online["num_drafts"] and len(spec["accepted_per_pos"]) == 4
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(metrics) if f.name.startswith("vllm:spec_decode")
               for s in f.samples if s.labels.get("model_name") == "copy"}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == spec["num_drafts"]
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == spec["num_draft_tokens"]
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == spec["num_accepted_tokens"] > 0
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(i))] for i in range(4)]
    assert per_pos == spec["accepted_per_pos"] and sum(per_pos) == spec["num_accepted_tokens"]
