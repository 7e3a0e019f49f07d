"""`lockgate serve --speculative-config` as a client meets it: one server for the module on the
copy demo model (whose answers quote their prompt, so n-gram drafts are accepted), answering
the official `openai` client streamed and not, with n=2, logprobs and a JSON schema, the same
greedy text as with speculation turned off per request (`"speculative": false`), and vLLM's
spec-decode counters moving on /metrics."""

from __future__ import annotations

import json
import re

import openai
import pytest

from lockgate.engine import write_copy_model
from tests.support.gateway_server import running_server

MODEL = "copy"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
PROMPT = "the quick brown fox jumps over the lazy dog near the river bank. the quick brown"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-serve")
    model = write_copy_model(root / "copy-model")
    with running_server(root, "embedded", models={MODEL: str(model)},
                        extra_args=["--speculative-config", json.dumps(SPEC)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    _, key = server.tenant()
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _counter(server, name: str) -> float:
    text = server.admin.get(server.url + "/metrics").text
    found = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(found)


def test_greedy_text_is_the_same_with_and_without_drafts_and_the_counters_move(server, client):
    before = _counter(server, "vllm:spec_decode_num_draft_tokens")
    accepted_before = _counter(server, "vllm:spec_decode_num_accepted_tokens")
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    spec = client.completions.create(**args)
    plain = client.completions.create(**{**args, "extra_body": {"ignore_eos": True, "speculative": False}})
    assert spec.choices[0].text == plain.choices[0].text and spec.usage.completion_tokens == 24
    streamed = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == spec.choices[0].text
    assert _counter(server, "vllm:spec_decode_num_draft_tokens") > before
    assert _counter(server, "vllm:spec_decode_num_accepted_tokens") > accepted_before


def test_n_two_and_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                         max_tokens=12, n=2, temperature=0.8, seed=7, logprobs=True,
                                         top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(out.choices) == 2 and out.usage.completion_tokens == 24
    for choice in out.choices:
        assert len(choice.logprobs.content) == 12
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in choice.logprobs.content)
    again = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=12, n=2, temperature=0.8, seed=7,
                                           extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_a_json_schema_answer_is_valid(client):
    schema = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["word", "n"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    data = json.loads(out.choices[0].message.content)
    assert set(data) == {"word", "n"} and 0 <= data["n"] <= 9
