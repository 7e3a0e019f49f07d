"""Several base models behind one gateway on one engine and one memory budget that holds
only one of them: chat completions for both, interleaved, each equal to HF transformers'
greedy output; the admin console shows the models taking turns (offloads, reloads), the
budget never exceeded."""

from __future__ import annotations

import json

import openai
import pytest

from lockgate.engine.config import EngineConfig
from lockgate.engine.model_pool import ModelPool
from lockgate.engine.tokenizer import Tokenizer
from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model, hf_greedy

ENGINE_KWARGS = {"num_kv_blocks": 48, "dtype": "float32"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = {"tiny": demo_model("llama", "tiny", 0), "tiny-qwen": demo_model("qwen2", "tiny", 1)}
    probe = ModelPool(EngineConfig(model=models["tiny"], served_model_name="tiny",
                                   models={"tiny-qwen": models["tiny-qwen"]}, enable_lora=True,
                                   max_loras=4, max_lora_rank=64, **ENGINE_KWARGS))
    sizes = [m.memory_bytes for m in probe.stats().pool.models.values()]
    budget = max(sizes) + min(sizes) // 2
    env = {"LOCKGATE_MEMORY_BUDGET": str(budget), "LOCKGATE_ENGINE_KWARGS": json.dumps(ENGINE_KWARGS)}
    with running_server(tmp_path_factory.mktemp("pool"), "embedded", models=models, extra_env=env) as srv:
        srv.models, srv.budget = models, budget
        yield srv


def test_two_models_on_a_one_model_budget_take_turns(server):
    _, key = server.tenant()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    for i in range(3):
        for name in ("tiny", "tiny-qwen"):
            prompt = [5 + i, 17, 42 + i, 9]
            r = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
            want = hf_greedy(server.models[name], prompt, 6)
            # the completion's text is the detokenized greedy continuation
            assert r.choices[0].text == Tokenizer(server.models[name]).decode(want, True), (name, i)
    models = {m["id"]: m for m in server.admin.get("/models").json()["data"]}
    tiny, qwen = models["tiny"], models["tiny-qwen"]
    assert tiny["loads"] >= 3 and tiny["offloads"] >= 2 and qwen["loads"] >= 3
    assert tiny["resident"] != qwen["resident"]
    pool = tiny["pool"]
    assert pool["memory"]["peak_used_bytes"] <= pool["memory"]["total_bytes"] == server.budget
    assert pool["switches"] >= 5
    assert tiny["waiting"] == tiny["running"] == 0
