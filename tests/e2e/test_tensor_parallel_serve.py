"""`lockgate serve --tensor-parallel-size 2` as a client meets it: one server for the module
(its rank process beside it), answering the official `openai` client, streamed and not, with
structured outputs; LoRA off and said so; --pipeline-parallel-size above 1 refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tp-serve"), "embedded",
                        models={MODEL: demo_model("llama", "tiny", 0)},
                        extra_args=["--tensor-parallel-size", "2"],
                        extra_env={"LOCKGATE_REQUEST_TIMEOUT_S": "60"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    _, key = server.tenant()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_answers_stream_and_not_with_lora_off(server, client):
    """Two ranks answer like one: the same greedy text streamed and not; the log says LoRA is
    off (serve turns it on at one rank)."""
    plain = client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert plain.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL, prompt="hello there", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    assert "LoRA adapters are off: with --tensor-parallel-size 2" in server.log()


def test_structured_output(client):
    """response_format json_schema: the answer parses and has the schema's fields."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a person"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)


def test_pipeline_parallel_refused(tmp_path):
    """--pipeline-parallel-size 2: refused before anything starts, naming the flag."""
    out = subprocess.run([sys.executable, "-m", "lockgate.gateway.cli", "serve", "--pipeline-parallel-size", "2",
                          "--data-dir", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "--pipeline-parallel-size" in out.stderr and "pipeline parallelism is not supported" in out.stderr


def test_engine_kwargs_tensor_parallel_turns_lora_off(monkeypatch, tmp_path):
    """LOCKGATE_ENGINE_KWARGS with tensor_parallel_size 2 does what the flag does: LoRA off,
    with the note; an explicit enable_lora is left to the engine (which says why it refuses)."""
    from lockgate.gateway.settings import Settings

    monkeypatch.setenv("LOCKGATE_ENGINE_KWARGS", json.dumps({"tensor_parallel_size": 2}))
    s = Settings(data_dir=tmp_path)
    assert s.lora_engine_kwargs()["enable_lora"] is False and "LoRA adapters are off" in (s.lora_off_note() or "")
    assert Settings(data_dir=tmp_path, engine_kwargs={"tensor_parallel_size": 2, "enable_lora": True}
                    ).lora_engine_kwargs()["enable_lora"] is True
    monkeypatch.delenv("LOCKGATE_ENGINE_KWARGS")
    assert Settings(data_dir=tmp_path).lora_engine_kwargs()["enable_lora"] is True
