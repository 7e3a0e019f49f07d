"""`lockgate serve` started with vLLM's engine flags (the command line is what is tested): each
flag reaches the engine, seen from outside (a bad --speculative-config is refused naming its
field), --kv-offloading-size sizes the host KV tier, and --gpu-memory-utilization says on a machine
without CUDA that it does nothing there. (vLLM's other conventions, in process:
test_vllm_compat.py.)"""

from __future__ import annotations

import time

import openai
import pytest
import torch

from lockgate.engine.config import ModelConfig
from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model

MODEL = "tiny"
FLAGS = ["--max-num-seqs", "1", "--max-model-len", "512", "--max-loras", "2", "--max-lora-rank", "8",
         "--gpu-memory-utilization", "0.5", "--dtype", "float", "--block-size", "16",
         "--enable-prefix-caching", "--kv-offloading-size", "0.01",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}']


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("vllm-flags"), "embedded",
                        models={MODEL: demo_model("llama", "tiny", 0)}, extra_args=FLAGS) as srv:
        yield srv


def client(server, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_vllm_engine_flags_reach_the_engine(server):
    """--max-model-len 512, --max-loras 2, --max-lora-rank 8, --max-num-seqs 1 (a second
    stream waits while one runs), each seen from outside; --gpu-memory-utilization says on the
    CPU that it does nothing there."""
    _, key = server.tenant()
    assert client(server, key).models.retrieve(MODEL).model_extra["max_model_len"] == 512
    engine = server.admin.get("/engine").json()["models"][MODEL]
    assert (engine["lora"]["max_loras"], engine["lora"]["max_lora_rank"]) == (2, 8)
    # --kv-offloading-size 0.01 (GiB): that many bytes of float32 K and V blocks of 16 tokens
    mc = ModelConfig.from_dir(demo_model("llama", "tiny", 0))
    per_block = 2 * mc.num_hidden_layers * 16 * mc.num_key_value_heads * mc.head_dim * 4
    assert engine["kv_tiers"]["host"]["capacity"] == int(0.01 * 2**30) // per_block
    spec = engine["speculative"]
    assert (spec["method"], spec["num_speculative_tokens"], spec["prompt_lookup_min"], spec["prompt_lookup_max"]) \
        == ("ngram", 3, 2, 2)
    # one slot: while a long stream runs, a second one waits (with two slots both would run)
    c = client(server, key)
    long = dict(model=MODEL, max_tokens=480, stream=True, extra_body={"ignore_eos": True})
    first = c.completions.create(prompt="one", **long)
    next(iter(first))
    second = c.completions.create(prompt="two", **long)
    seen = []
    for _ in range(200):
        engine = server.admin.get("/engine").json()["models"][MODEL]
        seen.append((sum(engine["running"].values()), sum(engine["waiting"].values())))
        if seen[-1] == (1, 1):
            break
        time.sleep(0.01)
    first.close()
    second.close()
    assert seen[-1] == (1, 1) and all(r <= 1 for r, _ in seen), seen
    if not torch.cuda.is_available():
        assert "--gpu-memory-utilization applies to CUDA devices" in server.log()


@pytest.mark.parametrize("value, named", [
    ("{not json", "--speculative-config"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config.method"),
    ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
    ('{"model": "/no/such/draft", "num_speculative_tokens": 2}', "speculative_config.model"),
])
def test_a_bad_speculative_config_is_refused_before_anything_starts(value, named):
    from typer.testing import CliRunner

    from lockgate.gateway.cli import app

    out = CliRunner().invoke(app, ["serve", "--speculative-config", value])
    assert out.exit_code == 2 and named in out.output, out.output
