"""Several base models behind one gateway (in process, the real engine) on one engine and
one memory budget that holds only one of them: chat completions for both, interleaved, each equal to HF transformers'
greedy output; the admin console shows the models taking turns (offloads, reloads), the
budget never exceeded."""

from __future__ import annotations

import pytest
import pytest_asyncio

from lockgate.engine.config import EngineConfig
from lockgate.engine.model_pool import ModelPool
from lockgate.engine.tokenizer import Tokenizer
from tests.support.helpers import demo_model, hf_greedy
from tests.support.inprocess_gateway import running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

ENGINE_KWARGS = {"num_kv_blocks": 48, "dtype": "float32"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory):
    models = {"tiny": demo_model("llama", "tiny", 0), "tiny-qwen": demo_model("qwen2", "tiny", 1)}
    probe = ModelPool(EngineConfig(model=models["tiny"], served_model_name="tiny",
                                   models={"tiny-qwen": models["tiny-qwen"]}, enable_lora=True,
                                   max_loras=4, max_lora_rank=64, **ENGINE_KWARGS))
    sizes = [m.memory_bytes for m in probe.stats().pool.models.values()]
    budget = max(sizes) + min(sizes) // 2
    async with running_gateway(tmp_path_factory.mktemp("pool"), engine="real", models=models,
                               engine_kwargs=ENGINE_KWARGS, memory_budget=budget) as gw:
        gw.models, gw.budget = models, budget
        yield gw


async def test_two_models_on_a_one_model_budget_take_turns(server):
    _, key = await server.tenant()
    client = server.openai(key)
    for i in range(3):
        for name in ("tiny", "tiny-qwen"):
            prompt = [5 + i, 17, 42 + i, 9]
            r = await client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0)
            want = hf_greedy(server.models[name], prompt, 6)
            # the completion's text is the detokenized greedy continuation
            assert r.choices[0].text == Tokenizer(server.models[name]).decode(want, True), (name, i)
    models = {m["id"]: m for m in (await server.admin.get("/models")).json()["data"]}
    tiny, qwen = models["tiny"], models["tiny-qwen"]
    assert tiny["loads"] >= 3 and tiny["offloads"] >= 2 and qwen["loads"] >= 3
    assert tiny["resident"] != qwen["resident"]
    pool = tiny["pool"]
    assert pool["memory"]["peak_used_bytes"] <= pool["memory"]["total_bytes"] == server.budget
    assert pool["switches"] >= 5
    assert tiny["waiting"] == tiny["running"] == 0
