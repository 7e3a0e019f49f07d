"""Tool calls under `tool_choice` `auto`, read out of the model's free text (gateway/auto_calls.py):
the reader on texts cut every way, then each API with the fake served engine's answers
scripted (what the model writes is the test's, not luck): a well-formed call of a declared
tool is a call, streamed and not (chat's `tool_calls`, Responses' `function_call` items,
Messages' `tool_use` blocks); a malformed or undeclared one stays content, as written."""

from __future__ import annotations

import json

import pytest

on_loop = pytest.mark.asyncio(loop_scope="module")

NAMES = frozenset({"get_weather"})
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TAGGED = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
NOT_CALLS = ['{"name": "get_time", "arguments": {}}',                      # undeclared
             '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',   # malformed
             '{"name": "get_weather", "arguments": "Paris"}',               # arguments not an object
             'I would call <tool_call>{"name": "get_weather"',             # never closed
             '{"city": "Paris"} is where it is.', 'a < b <tool_c']
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize("text", [BARE, TAGGED, f"{BARE}\n", f"[{BARE}, {BARE}]", f"{TAGGED}\n{TAGGED[13:]}"])
def test_calls_are_read_however_the_text_is_cut(text):
    from lockgate.gateway.auto_calls import AutoCallReader, read_auto  # here: the API tests run on older code
    content, calls = read_auto(text, NAMES)
    assert calls and all(json.loads(c["function"]["arguments"]) == {"city": "Paris"} for c in calls)
    assert content in ("", "Let me look.\n")
    for step in (1, 2, 7):
        reader = AutoCallReader(NAMES)
        events = [e for i in range(0, len(text), step) for e in reader.feed(text[i:i + step])] + reader.finish()
        assert "".join(v for k, v in events if k == "content") == content
        assert [v["function"] for k, v in events if k == "call"] == [c["function"] for c in calls]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_what_is_not_a_well_formed_declared_call_stays_content(text):
    from lockgate.gateway.auto_calls import AutoCallReader, read_auto  # here: the API tests run on older code
    assert read_auto(text, NAMES) == (text, [])
    reader = AutoCallReader(NAMES)
    events = [e for ch in text for e in reader.feed(ch)] + reader.finish()
    assert "".join(v for k, v in events if k == "content") == text and not reader.calls


def test_without_parallel_calls_a_second_call_stays_content():
    from lockgate.gateway.auto_calls import read_auto  # here: the API tests run on older code
    two = f"{TAGGED}\n<tool_call>{BARE}</tool_call>"
    content, calls = read_auto(two, NAMES, max_calls=1)
    assert len(calls) == 1 and content == f"Let me look.\n<tool_call>{BARE}</tool_call>"   # the space between: neither
    assert read_auto(f"[{BARE}, {BARE}]", NAMES, max_calls=1) == (f"[{BARE}, {BARE}]", [])
    assert len(read_auto(two, NAMES)[1]) == 2


async def chat_events(gateway, key: str, **body) -> list[dict]:
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 200, "stream": True, **body}
    async with gateway.http.stream("POST", "/v1/chat/completions", json=body,
                                   headers={"authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) async for line in r.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@on_loop
async def test_chat_auto_reads_calls_streamed_and_not(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    gateway.engine.answers[:] = [TAGGED, TAGGED, *NOT_CALLS]
    r = await c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    events = await chat_events(gateway, key)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look.\n"
    [streamed] = [t for d in deltas for t in d.get("tool_calls") or []]
    assert streamed["index"] == 0 and streamed["function"]["name"] == "get_weather"
    assert json.loads(streamed["function"]["arguments"]) == {"city": "Paris"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    for text in NOT_CALLS:
        r = await c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200)
        assert (r.choices[0].message.content, r.choices[0].message.tool_calls) == (text, None)
        assert r.choices[0].finish_reason == "stop"
    # parallel_tool_calls false: the first call only, streamed and not
    two = f"{TAGGED}\n<tool_call>{BARE}</tool_call>"
    gateway.engine.answers[:] = [two, two]
    r = await c.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200,
                                        parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1 and BARE in r.choices[0].message.content
    deltas = [e["choices"][0]["delta"] for e in await chat_events(gateway, key, parallel_tool_calls=False)]
    assert len([t for d in deltas for t in d.get("tool_calls") or []]) == 1


@on_loop
async def test_responses_auto_reads_function_calls_streamed_and_not(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    gateway.engine.answers[:] = [TAGGED, TAGGED, NOT_CALLS[0]]
    r = await c.responses.create(model="tiny", input="Weather in Paris?", tools=tools, store=False)
    assert [i.type for i in r.output] == ["message", "function_call"] and r.status == "completed"
    assert r.output[0].content[0].text == "Let me look.\n"
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    async with c.responses.stream(model="tiny", input="Weather in Paris?", tools=tools, store=False) as s:
        kinds = [e.type async for e in s]
        final = await s.get_final_response()
    assert [i.type for i in final.output] == ["message", "function_call"]
    assert json.loads(final.output[1].arguments) == {"city": "Paris"}
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    r = await c.responses.create(model="tiny", input="Weather in Paris?", tools=tools, store=False)
    assert [i.type for i in r.output] == ["message"] and r.output_text == NOT_CALLS[0]


@on_loop
async def test_messages_auto_reads_tool_use_streamed_and_not(gateway, tenant):
    from tests.gateway.test_messages_api import client
    _, key = tenant
    c = client(gateway, key)
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    gateway.engine.answers[:] = [BARE, BARE, NOT_CALLS[1]]
    m = await c.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=tools)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "get_weather" and m.content[0].input == {"city": "Paris"}
    async with c.messages.stream(model="tiny", max_tokens=200, messages=ASK, tools=tools) as s:
        kinds = [e.type async for e in s]
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"city": "Paris"}
    assert "input_json" in kinds and "text" not in kinds
    m = await c.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=tools)
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == NOT_CALLS[1]
