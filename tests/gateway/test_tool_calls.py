"""The gateway's side of structured outputs without a server: tool calls read from a
growing answer, the forced-call schema, the tools in the prompt, and the constraint checks
(conflicts, size, compile time)."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
from types import SimpleNamespace

import jsonschema
import pytest

from lockgate.gateway import structured
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_catalog import read_model_info
from lockgate.gateway.protocol import ChatCompletionRequest, ChatMessage, Tool
from lockgate.gateway.tool_calls import ToolCallReader, prompt_messages, read_tool_calls, rebase_refs, tool_plan
from tests.support.helpers import demo_model

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}
TOOLS = [Tool.model_validate(t) for t in (
    {"type": "function", "function": {"name": "move", "parameters": {
        "$defs": {"P": POINT}, "type": "object", "required": ["to", "note"], "additionalProperties": False,
        "properties": {"to": {"$ref": "#/$defs/P"}, "note": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "stop"}},
)]


@pytest.mark.parametrize("text", [
    '{"name":"move","arguments":{"to":{"x":1},"note":"a } \\" ] { [ b"}}',
    '[{"name":"move","arguments":{"to":{"x":-2},"note":""}},{"name":"stop","arguments":{}}]',
    '{"name":"f","arguments":5}',
    '{"name":"g","arguments":[1,[2,{"a":"}"}]]}',
])
def test_reader_gives_the_same_calls_however_the_text_is_cut(text):
    whole = read_tool_calls(text)
    expected = json.loads(text)
    expected = expected if isinstance(expected, list) else [expected]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == \
        [(e["name"], e["arguments"]) for e in expected]
    rng = random.Random(text)  # noqa: S311 - seeded cuts, not a secret
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
        reader = ToolCallReader()
        deltas = []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            deltas += reader.feed(text[a:b])
        assert [c["function"] for c in reader.tool_calls()] == [c["function"] for c in whole]
        # the deltas add up: each call's id and name once, then its arguments in pieces
        starts = [d for d in deltas if "id" in d]
        assert [d["function"]["name"] for d in starts] == [e["name"] for e in expected]
        for i in range(len(expected)):
            pieces = "".join(d["function"]["arguments"] for d in deltas if d["index"] == i)
            assert json.loads(pieces) == expected[i]["arguments"]


def test_cut_short_answer_is_not_calls():
    assert read_tool_calls('{"name":"move","arguments":{"to":') is None


def test_rebase_refs_points_local_references_into_their_new_place():
    schema = {"a": {"$ref": "#/$defs/P"}, "b": [{"$ref": "#"}], "c": {"$ref": "http://x/y#/z"}}
    assert rebase_refs(schema, "#/$defs/tool3") == {
        "a": {"$ref": "#/$defs/tool3/$defs/P"}, "b": [{"$ref": "#/$defs/tool3"}], "c": {"$ref": "http://x/y#/z"}}
    assert schema["a"]["$ref"] == "#/$defs/P"      # a copy


def test_forced_schemas_accept_calls_and_refuse_others():
    required = tool_plan(TOOLS, "required", False).schema()
    parallel = tool_plan(TOOLS, "required", None).schema()
    named = tool_plan(TOOLS, SimpleNamespace(function=SimpleNamespace(name="stop")), False).schema()
    move = {"name": "move", "arguments": {"to": {"x": 3}, "note": "n"}}
    stop = {"name": "stop", "arguments": {}}
    jsonschema.validate(move, required)
    jsonschema.validate(stop, named)
    jsonschema.validate([move, stop], parallel)
    for doc, schema in (({"name": "move", "arguments": {"to": {"x": "3"}, "note": "n"}}, required),
                        (move, named), ([], parallel), ([move] * 9, parallel),
                        ({"name": "stop", "arguments": {"extra": 1}}, required)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(doc, schema)


def test_tool_choice_must_name_a_tool():
    with pytest.raises(APIError) as exc:
        tool_plan(TOOLS, SimpleNamespace(function=SimpleNamespace(name="fly")), None)
    assert exc.value.param == "tool_choice.function.name"
    with pytest.raises(APIError) as exc:
        tool_plan(None, "required", None)
    assert exc.value.param == "tool_choice"
    assert tool_plan(None, "none", None) is None
    assert not tool_plan(TOOLS, None, None).forced


def test_tools_in_a_system_message_when_the_template_has_no_place_for_them():
    msgs = [ChatMessage.model_validate(m) for m in (
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "stop", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    )]
    plan = tool_plan(TOOLS, "required", False)
    out, tools = prompt_messages(msgs, plan, template_renders_tools=False)
    assert tools is None and len(out) == 4
    assert out[0]["role"] == "system" and out[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "move"' in out[0]["content"] and "You must call a function now." in out[0]["content"]
    assert out[2]["content"] == '{"name":"stop","arguments":{}}'
    assert out[3] == {"role": "tool", "content": "done", "tool_call_id": "call_1"}
    out, tools = prompt_messages(msgs, plan, template_renders_tools=True)
    assert [t["function"]["name"] for t in tools] == ["move", "stop"]
    assert out[0] == {"role": "system", "content": "Be brief."}
    assert out[2]["tool_calls"][0]["function"] == {"name": "stop", "arguments": {}}
    out, tools = prompt_messages(msgs[1:2], tool_plan(TOOLS, "none", None), template_renders_tools=False)
    assert out == [{"role": "user", "content": "go"}] and tools is None


def _req(**body):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], **body})


def test_one_constraint_at_a_time():
    assert structured.requested(_req()) is None
    spec, param = structured.requested(_req(guided_choice=["a", "b"]))
    assert spec.choice == ["a", "b"] and param == "guided_choice"
    spec, param = structured.requested(_req(structured_outputs={"regex": "a+"}))
    assert spec.regex == "a+" and param == "structured_outputs.regex"
    assert structured.requested(_req(response_format={"type": "text"})) is None
    with pytest.raises(APIError) as exc:
        structured.requested(_req(response_format={"type": "json_object"}, guided_json={"type": "object"}))
    assert exc.value.param == "guided_json"
    with pytest.raises(APIError) as exc:
        structured.requested(_req(structured_outputs={"regex": "a", "choice": ["b"]}))
    assert exc.value.param == "structured_outputs"
    with pytest.raises(APIError) as exc:
        structured.requested(_req(guided_regex=""))
    assert exc.value.param == "guided_regex"


def test_large_and_slow_schemas_are_refused_before_the_engine():
    info = read_model_info("tiny", demo_model("llama"))
    settings = SimpleNamespace(max_schema_bytes=4096, grammar_compile_timeout_s=0.001)
    big = {"enum": [f"{secrets.token_hex(4)}-{i}" for i in range(400)]}     # ~6 KB, new each run
    with pytest.raises(APIError) as exc:
        asyncio.run(structured.check(settings, info, structured.StructuredOutputsParams(json=big), "guided_json"))
    assert exc.value.code == "schema_too_large" and exc.value.param == "guided_json"
    settings.max_schema_bytes = 1 << 20
    slow = {"enum": [f"{secrets.token_hex(4)}-{i}" for i in range(5000)]}
    for _ in range(2):      # still compiling, then compiled but slower than the limit: refused both times
        with pytest.raises(APIError) as exc:
            asyncio.run(structured.check(settings, info, structured.StructuredOutputsParams(json=slow), "p"))
        assert exc.value.code == "schema_too_complex"
    settings.grammar_compile_timeout_s = 30.0
    asyncio.run(structured.check(settings, info, structured.StructuredOutputsParams(json=slow), "p"))
