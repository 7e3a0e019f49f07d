"""What a new user hit with the official clients against the gateway in process, on both
backends with the fake served engine, each fixed and kept so: a stream of `n` samples that
end at different steps says each one's finish_reason once (chat and completions); OpenAI's
fields that ask nothing of the model accepted (`metadata`, `store`, `prompt_cache_key`,
`safety_identifier`), `logit_bias` passed to the engine, vLLM's `add_generation_prompt` and
`chat_template_kwargs` applied to the chat template, and what Lockgate cannot honour still a
400 naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import pytest_asyncio

from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
# sample 0 ends first, sample 2 last: the engine's outputs keep an ended sample, reason and all
SAMPLES = ["One.", "One, two.", "One, two, three, four."]


async def _events(gateway, key: str, route: str, body: dict) -> list[dict]:
    gateway.engine.answers[:] = [SAMPLES]
    async with gateway.http.stream("POST", route, headers=gateway.auth(key), json=body) as r:
        assert r.status_code == 200
        lines = [ln async for ln in r.aiter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def _finishes(events: list[dict]) -> list[tuple[int, str]]:
    return [(c["index"], c["finish_reason"]) for e in events for c in e["choices"] if c["finish_reason"]]


def _texts(events: list[dict], field) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + (field(c) or "")
    return texts


async def test_chat_stream_of_n_says_each_finish_reason_once(gateway, tenant):
    _, key = tenant
    events = await _events(gateway, key, "/v1/chat/completions",
                           {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "n": 3,
                            "max_tokens": 50, "stream": True})
    assert sorted(_finishes(events)) == [(0, "stop"), (1, "stop"), (2, "stop")]
    assert _texts(events, lambda c: c["delta"].get("content")) == dict(enumerate(SAMPLES))


async def test_completions_stream_of_n_says_each_finish_reason_once(gateway, tenant):
    _, key = tenant
    events = await _events(gateway, key, "/v1/completions",
                           {"model": MODEL, "prompt": "count", "n": 3, "max_tokens": 50, "stream": True})
    assert sorted(_finishes(events)) == [(0, "stop"), (1, "stop"), (2, "stop")]
    assert _texts(events, lambda c: c["text"]) == dict(enumerate(SAMPLES))


# -- fields OpenAI's clients send --------------------------------------------------------------------
HARMLESS = {"metadata": {"team": "search", "run": "7"}, "store": False, "prompt_cache_key": "tenant-docs-v2",
            "safety_identifier": "user-5f2a"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


async def test_harmless_openai_fields_are_accepted(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    r = await c.chat.completions.create(**CHAT, **HARMLESS, logit_bias={"5": 2.5, "17": -100})
    assert r.choices[0].finish_reason == "length"
    assert gateway.engine.submitted[-1][1].logit_bias == {5: 2.5, 17: -100.0}
    # prompt_cache_key reaches the engine as its routing hint (a pool keeps such requests together)
    assert gateway.engine.submitted[-1][2]["cache_hint"] == "tenant-docs-v2"
    r = await c.completions.create(**COMPLETION, extra_body=HARMLESS, logit_bias={"9": 100})
    assert r.choices[0].finish_reason == "length"
    assert gateway.engine.submitted[-1][1].logit_bias == {9: 100.0}
    assert gateway.engine.submitted[-1][2]["cache_hint"] == "tenant-docs-v2"
    await c.responses.create(model=MODEL, input="hi", max_output_tokens=3, prompt_cache_key="conv-9")
    assert gateway.engine.submitted[-1][2]["cache_hint"] == "conv-9"
    await c.chat.completions.create(**CHAT)
    assert gateway.engine.submitted[-1][2]["cache_hint"] is None
    # the same through a stream
    chunks = [x async for x in await c.chat.completions.create(**CHAT, **HARMLESS, stream=True)]
    assert chunks[-1].choices[0].finish_reason == "length"


SPECULATIVE_ROUTES = [
    ("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 3}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
]


async def test_speculative_false_reaches_the_engine_from_every_api(gateway, tenant):
    """Lockgate's `speculative` (default true) becomes the engine's SamplingParams.speculative
    on chat, completions, Responses and Messages; a non-boolean is a 400 naming it."""
    _, key = tenant
    for route, body in SPECULATIVE_ROUTES:
        for value in (False, True, None):
            sent = body if value is None else {**body, "speculative": value}
            r = await gateway.http.post(route, headers=gateway.auth(key), json=sent)
            assert r.status_code == 200, (route, r.text)
            assert gateway.engine.submitted[-1][1].speculative is (value is not False), (route, value)
        r = await gateway.http.post(route, headers=gateway.auth(key), json={**body, "speculative": "no"})
        assert r.status_code == 400 and "speculative" in r.text, (route, r.text)


@pytest.mark.parametrize("route, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"5": 101}), ("logit_bias", {"five": 1}), ("logit_bias", {"-3": 1}),
    ("logit_bias", {"1000000": 1}),                  # outside the vocabulary (the engine's check)
    ("logit_bias", {str(i): 1 for i in range(301)}), ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("metadata", {"k": 5}), ("store", "yes"), ("safety_identifier", "x" * 65),
])
async def test_bad_values_of_accepted_fields_are_400s_naming_them(gateway, tenant, route, body, field, value):
    _, key = tenant
    r = await gateway.http.post(route, headers=gateway.auth(key), json={**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].split(".")[0] == field and field in err["message"], err


@pytest.mark.parametrize("route, body, field, value", [
    ("/v1/chat/completions", CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", CHAT, "modalities", ["text", "audio"]),
    ("/v1/chat/completions", CHAT, "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", CHAT, "reasoning_effort", "low"),
    ("/v1/chat/completions", CHAT, "web_search_options", {}),
    ("/v1/chat/completions", CHAT, "functions", [{"name": "f"}]),
    ("/v1/completions", COMPLETION, "suffix", "!"), ("/v1/completions", COMPLETION, "echo", True),
    ("/v1/completions", COMPLETION, "best_of", 2),
    ("/v1/chat/completions", CHAT, "chat_template_kwargs", {"tools": []}),     # the template's own argument
])
async def test_what_lockgate_cannot_honour_is_a_400_naming_it(gateway, tenant, route, body, field, value):
    _, key = tenant
    r = await gateway.http.post(route, headers=gateway.auth(key), json={**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


async def test_add_generation_prompt_false_leaves_the_prompt_at_the_last_message(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    with_prompt = await c.chat.completions.create(**CHAT)
    without = await c.chat.completions.create(**CHAT, extra_body={"add_generation_prompt": False})
    assert 0 < without.usage.prompt_tokens < with_prompt.usage.prompt_tokens


def _model_with_template_variable(path: Path) -> str:
    """The demo model, its chat template starting with the variable `greeting` when set."""
    shutil.copytree(demo_model(), path)
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = "{% if greeting %}{{ greeting }}\n{% endif %}" + cfg["chat_template"]
    cfg_path.write_text(json.dumps(cfg))
    return str(path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def templated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("templated")
    # chats of 1,000 characters and more go to the tokenizer pool's workers
    async with running_gateway(tmp / "data", models={MODEL: _model_with_template_variable(tmp / "model")},
                               tokenizer_inline_chars=1_000) as gw:
        yield gw


async def test_chat_template_kwargs_reach_the_template(templated):
    _, key = await templated.tenant()
    c = templated.openai(key)
    plain = await c.chat.completions.create(**CHAT)
    greeted = await c.chat.completions.create(**CHAT, extra_body={
        "chat_template_kwargs": {"greeting": "Good morning to the whole team"}})
    assert greeted.usage.prompt_tokens > plain.usage.prompt_tokens
    # through the tokenizer pool's workers too (a chat over its inline bound)
    long = {**CHAT, "messages": [{"role": "user", "content": "word " * 300}]}
    plain = await c.chat.completions.create(**long)
    greeted = await c.chat.completions.create(**long, extra_body={"chat_template_kwargs": {"greeting": "Hi all"}})
    assert greeted.usage.prompt_tokens > plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(**CHAT, extra_body={"chat_template_kwargs": {"tokenize": True}})
    with pytest.raises(openai.BadRequestError):
        await c.chat.completions.create(**CHAT, extra_body={"chat_template_kwargs": {"sanitize_control_tokens": False}})
