"""Structured outputs and tool calls through the HTTP API, with the official `openai` client,
against the gateway in process with the real engine on the random-weight demo model (free
output is noise: only the grammar makes it parse)."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, ConfigDict, Field

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "days"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["tz"],
        "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}}}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")     # additionalProperties: false, a bounded schema
    kind: Literal["cat", "dog", "fish"]
    age: Annotated[int, Field(ge=0, le=30)]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(max_length=12)]
    pets: Annotated[list[Pet], Field(max_length=3)]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(model_gateway):
    _, key = await model_gateway.tenant()
    return model_gateway.openai(key)


def _check_calls(calls, names=PARAMS) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


async def test_parse_with_a_pydantic_model(client):
    """`chat.completions.parse` sends a strict json_schema and parses the answer into the
    model; with several choices and seeds, each parses."""
    stops = 0
    for seed in range(4):
        r = await client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": f"Person {seed}?"}],
                                                response_format=Person, max_tokens=120, n=2, seed=seed)
        for choice in r.choices:
            if choice.finish_reason == "stop":
                assert isinstance(choice.message.parsed, Person)
                stops += 1
    assert stops >= 7


async def test_json_schema_streamed_and_json_object(client):
    schema = Person.model_json_schema()
    for seed in range(3):
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"again {seed}"}], stream=True, seed=seed,
            max_tokens=120, response_format={"type": "json_schema",
                                             "json_schema": {"name": "person", "schema": schema, "strict": True}})
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)
    r = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=60,
                                             response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


async def test_required_tool_call(client):
    for seed in range(3):
        r = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=80, seed=seed, temperature=1.0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls)


async def test_parallel_tool_calls_are_a_list(client):
    r = await client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                             max_tokens=400)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    assert 1 <= len(choice.message.tool_calls) <= 8
    _check_calls(choice.message.tool_calls)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


async def test_named_tool_call_streams_as_deltas(client):
    stream = await client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, stream=True, max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    finish = None
    async for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert call["id"] is None
                call["id"], call["name"] = d.id, d.function.name
            call["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER)


async def test_parse_tool_arguments_and_send_the_results_back(client):
    """A pydantic tool, its arguments parsed by the client; then the assistant's call and the
    tool's answer go back in the conversation, and `auto` decodes freely."""

    class GetTime(BaseModel):
        tz: Literal["UTC", "CET", "PST"]

    tool = openai.pydantic_function_tool(GetTime)
    r = await client.chat.completions.parse(model="tiny", messages=USER, tools=[tool], max_tokens=40,
                                            tool_choice={"type": "function", "function": {"name": "GetTime"}})
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetTime)
    messages = [*USER, r.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    r2 = await client.chat.completions.create(model="tiny", messages=messages, tools=[tool], max_tokens=8)
    assert r2.choices[0].message.content is not None and r2.choices[0].message.tool_calls is None
    assert r2.choices[0].finish_reason in ("stop", "length")


async def test_vllm_guided_fields_on_completions(client):
    r = await client.completions.create(model="tiny", prompt="Pick one:", max_tokens=10,
                                        extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].text in ("alpha", "beta") and r.choices[0].finish_reason == "stop"
    r = await client.completions.create(model="tiny", prompt="Code:", max_tokens=20,
                                        extra_body={"guided_regex": "[A-Z]{2}-[0-9]{3}"})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 6
    r = await client.completions.create(model="tiny", prompt="JSON:", max_tokens=60,
                                        extra_body={"structured_outputs": {"json": WEATHER}})
    jsonschema.validate(json.loads(r.choices[0].text), WEATHER)
    r = await client.chat.completions.create(model="tiny", messages=USER, max_tokens=60,
                                             extra_body={"guided_json": json.dumps(WEATHER)})
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)


@pytest.mark.parametrize("kwargs, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}]},
     "tools[1].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    ({"extra_body": {"guided_regex": "(a{2000}){1000}"}}, "guided_regex"),       # a grammar bomb
    ({"extra_body": {"structured_outputs": {"regex": "x{100000}"}}}, "structured_outputs.regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "enum": ["x" * 100] * 1000}}}}, "response_format.json_schema.schema"),
])
async def test_bad_constraints_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, **kwargs)
    assert exc.value.body["param"] == param, exc.value.body
