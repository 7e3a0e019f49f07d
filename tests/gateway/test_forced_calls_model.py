"""Forced tool calls end, against the real engine on the random-weight demo model (its free
text is noise: only the grammar makes a call end): the README's tool-call example with
`tool_choice` `required` gives a call every time, whose arguments parse and match the schema;
`strict` closes every object as OpenAI's strict mode does; and a call cut by `max_tokens` has
one shape, streamed or not (its calls so far, `content` null, finish_reason "length")."""

from __future__ import annotations

import json

import jsonschema
import pytest

from lockgate.gateway.protocol import Tool

on_loop = pytest.mark.asyncio(loop_scope="module")

# the README's example ("Structured outputs and tools"), on the test's model
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": PARAMETERS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
STRICT = {**PARAMETERS, "additionalProperties": False}


def test_strict_closes_every_object_and_requires_every_property():
    from lockgate.gateway.tool_calls import ToolPlan
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "string"}}}
    for strict in (True, False):
        tool = Tool.model_validate({"type": "function", "function": {"name": "f", "strict": strict,
                                                                       "parameters": nested}})
        args = ToolPlan([tool], "required", False).schema()["$defs"]["tool0"]
        assert args["additionalProperties"] is False and args["properties"]["a"]["additionalProperties"] is False
        assert (args.get("required"), args["properties"]["a"].get("required")) == (
            (["a", "c"], ["b"]) if strict else (None, None))
        jsonschema.validate({"a": {"b": 1}, "c": "x"}, args)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"a": {"b": 1}, "c": "x", "extra": 1}, args)


@on_loop
async def test_the_readme_forced_call_ends_every_time(model_gateway):
    _, key = await model_gateway.tenant()
    c = model_gateway.openai(key)
    calls = []
    for _ in range(8):
        r = await c.chat.completions.create(model="tiny", tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=100, messages=ASK)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        calls.append(r.choices[0].message.tool_calls[0])
    assert len(calls) == 8 and {call.function.name for call in calls} == {"get_weather"}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), STRICT)


@on_loop
async def test_a_call_cut_by_max_tokens_has_one_shape_streamed_or_not(gateway, tenant):
    """On the fake engine, its answer scripted: the call's JSON, cut 3 tokens before its end."""
    _, key = tenant
    c = gateway.openai(key)
    call_text = '{"name":"get_weather","arguments":{"city":"Paris and around"}}'
    cut = len(gateway.engine.tokenizer.encode(call_text, add_special_tokens=False)) - 3
    gateway.engine.answers[:] = [call_text, call_text]
    kw = {"model": "tiny", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
          "max_tokens": cut, "messages": ASK}
    r = await c.chat.completions.create(**kw)
    whole = r.choices[0]
    assert (whole.finish_reason, whole.message.content) == ("length", None)
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city":"Paris')
    stream = await c.chat.completions.create(**kw, stream=True)
    chunks = [ch async for ch in stream]
    deltas = [ch.choices[0].delta for ch in chunks]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert not any(d.content for d in deltas)
    pieces = [t for d in deltas for t in d.tool_calls or []]
    assert {t.index for t in pieces} == {0} and pieces[0].function.name == "get_weather"
    assert "".join(t.function.arguments or "" for t in pieces) == call.function.arguments
