"""Anthropic's Messages API with the official `anthropic` client against the gateway in
process, on both backends with the fake served engine (its answers scripted where what the
model writes matters: a tool call), and on the real engine for the prefix cache's tokens:
text and tool calls (a `tool_use`, then its `tool_result`), streamed and not, count_tokens,
model aliases, errors in Anthropic's shape with the client's own exceptions, usage rows."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx2
import pytest
import pytest_asyncio

from lockgate.gateway.serving.messages import alias_of
from tests.support.httpx2_bridge import Httpx2Bridge

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
GATEWAY_OPTIONS = {"model_aliases": {"claude-*": MODEL, "claude-3-5-haiku-latest": MODEL}}
MODEL_GATEWAY_OPTIONS = {"model_aliases": {"claude-*": MODEL}}
SONNET = "claude-sonnet-4-5-20250929"       # as Claude Code sends it
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"], "additionalProperties": False}}
CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
HELLO = [{"role": "user", "content": "Say hello."}]


def client(gw, key: str) -> anthropic.AsyncAnthropic:
    """The official client on the app in process: no retries (a 429 is raised, not waited out)."""
    http = httpx2.AsyncClient(transport=Httpx2Bridge(gw.transport), base_url=gw.url, timeout=60)
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0, http_client=http)


async def usage_of(gw, tenant_id: str) -> dict:
    r = await gw.admin.get("/usage", params={"tenant_id": tenant_id})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    return data[0] if data else {"requests": 0, "ok": 0}


@pytest_asyncio.fixture(loop_scope="module")
async def fresh(gateway):
    """A tenant of its own (its usage rows counted from zero) and its key."""
    return await gateway.tenant()


async def test_create_text_with_an_alias_and_usage(gateway, fresh):
    t, key = fresh
    c = client(gateway, key)
    m = await c.messages.create(model=SONNET, max_tokens=8, messages=HELLO,
                                system=[{"type": "text", "text": "Be brief.",
                                         "cache_control": {"type": "ephemeral"}}],
                                metadata={"user_id": "u1"}, extra_body={"temperature": 0.5, "top_k": 40},
                                cache_control={"type": "ephemeral"},
                                extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    assert m.type == "message" and m.role == "assistant" and m.model == SONNET and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 8 and m.usage.cache_creation_input_tokens == 0
    counted = await c.messages.count_tokens(model=SONNET, messages=HELLO, system="Be brief.")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens
    u = await usage_of(gateway, t["id"])
    assert (u["requests"], u["ok"], u["prompt_tokens"], u["completion_tokens"]) == (1, 1, counted.input_tokens, 8)
    assert u["budget_tokens"] == counted.input_tokens + 8
    _, sp, options = gateway.engine.submitted[-1]
    assert (sp.max_tokens, sp.temperature, sp.top_k, options["tenant"]) == (8, 0.5, 40, t["id"])


async def test_stream_text_events_in_anthropic_order(gateway, fresh):
    t, key = fresh
    body = {"model": SONNET, "max_tokens": 6, "messages": HELLO, "stream": True}
    async with gateway.http.stream("POST", "/v1/messages", json=body,
                                   headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds == (["message_start", "ping", "content_block_start"] + ["content_block_delta"] * 6
                     + ["content_block_stop", "message_delta", "message_stop"])
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 6
    async with client(gateway, key).messages.stream(model=SONNET, max_tokens=6, messages=HELLO) as s:
        text = "".join([piece async for piece in s.text_stream])
        final = await s.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == text
    assert (await usage_of(gateway, t["id"]))["requests"] == 2       # one row per 200


async def test_tool_use_then_tool_result_round_trip(gateway, fresh):
    t, key = fresh
    c = client(gateway, key)
    gateway.engine.answers[:] = [CALL, "It is sunny in Paris."]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    m = await c.messages.create(model=SONNET, max_tokens=64, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    call = m.content[0]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "Sunny, 24 C"}]}
    followed = [*ask, {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                {"role": "user", "content": [result]}]
    m2 = await c.messages.create(model=SONNET, max_tokens=64, messages=followed, tools=[WEATHER])
    assert m2.stop_reason == "end_turn" and m2.content[0].text == "It is sunny in Paris."
    longer = await c.messages.count_tokens(model=SONNET, messages=followed, tools=[WEATHER])
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == longer.input_tokens
    assert longer.input_tokens > (await c.messages.count_tokens(model=SONNET, messages=followed)).input_tokens
    assert (await usage_of(gateway, t["id"]))["requests"] == 2


async def test_stream_a_forced_tool_call(gateway, fresh):
    _, key = fresh
    gateway.engine.answers[:] = [CALL]
    async with client(gateway, key).messages.stream(
            model=SONNET, max_tokens=64, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
            tool_choice={"type": "tool", "name": "get_weather"}) as s:
        kinds = [e.type async for e in s]
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use" and len(final.content) == 1
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}
    assert "input_json" in kinds and "text" not in kinds


@pytest.mark.parametrize("max_tokens, read", [(4, None), (27, {}), (36, {}), (44, {"city": "Paris"})])
async def test_a_forced_call_cut_by_max_tokens_has_one_shape_streamed_or_not(gateway, fresh, max_tokens, read):
    """Cut before the call's name, at its arguments' start, inside a string, or after a whole
    key: the message and the stream's final message (as the client reads it) hold the same
    blocks."""
    _, key = fresh
    c = client(gateway, key)
    ask = {"model": SONNET, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Weather?"}],
           "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}
    gateway.engine.answers[:] = ['{"name":"get_weather","arguments":{"city":"Paris","days":3}}'] * 2
    whole = await c.messages.create(**ask)
    async with c.messages.stream(**ask) as s:
        streamed = await s.get_final_message()

    def shape(m):
        return [(b.type, getattr(b, "name", None), getattr(b, "input", None), getattr(b, "text", None))
                for b in m.content]

    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert shape(whole) == shape(streamed), (shape(whole), shape(streamed))
    # never the call's raw JSON as text: its block once its name is read, with the input so far
    assert shape(whole) == ([] if read is None else [("tool_use", "get_weather", read, None)])


async def test_a_client_that_leaves_mid_stream_leaves_one_row_and_its_lease_settled(gateway):
    t, key = await gateway.tenant(quota={"max_concurrent_requests": 4})
    body = {"model": SONNET, "max_tokens": 60, "messages": HELLO, "stream": True}
    async with gateway.http.stream("POST", "/v1/messages", json=body, headers={"x-api-key": key}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if "content_block_delta" in line:
                break                                   # gone after the first delta
    deadline = time.monotonic() + 10                    # the run ends as the app sees the client leave
    while (u := await usage_of(gateway, t["id"]))["requests"] == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert gateway.engine.open_requests == 0
    assert (u["requests"], u["ok"] + u["cancelled"]) == (1, 1)
    quota = (await gateway.http.get("/v1/usage/quota", headers=gateway.auth(key))).json()["data"][0]
    assert quota["limits"]["max_concurrent_requests"]["used"] == 0     # the lease went back


async def test_over_quota_is_a_rate_limit_error(gateway):
    t, key = await gateway.tenant(quota={"daily_token_budget": 5})
    with pytest.raises(anthropic.RateLimitError) as info:
        await client(gateway, key).messages.create(model=SONNET, max_tokens=8, messages=HELLO)
    assert info.value.status_code == 429
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "rate_limit_error"
    assert "daily_token_budget" in info.value.body["error"]["message"]
    assert (await usage_of(gateway, t["id"]))["requests"] == 0


@pytest.mark.parametrize("extra, named", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]}, "messages[0].content[0].type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"container": "c1"}, "container"),
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}}, "mcp_servers"),
    ({"extra_body": {"speed": "fast"}}, "speed"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"model": "gpt-nonesuch"}, None),
])
async def test_what_lockgate_cannot_honour_is_a_bad_request(gateway, tenant, extra, named):
    _, key = tenant
    kw = {"model": SONNET, "max_tokens": 8, "messages": HELLO, **extra}
    with pytest.raises(anthropic.APIStatusError) as info:
        await client(gateway, key).messages.create(**kw)
    err = info.value.body["error"]
    if named is None:
        assert isinstance(info.value, anthropic.NotFoundError) and err["type"] == "not_found_error"
        assert "gpt-nonesuch" in err["message"]
        return
    assert isinstance(info.value, anthropic.BadRequestError) and info.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["message"].startswith(named)


async def test_keys_by_x_api_key_or_bearer_and_a_bad_one(gateway, tenant):
    _, key = tenant
    with pytest.raises(anthropic.AuthenticationError) as info:
        await client(gateway, "lg-not-a-key").messages.create(model=SONNET, max_tokens=4, messages=HELLO)
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        await client(gateway, "lg-not-a-key").messages.count_tokens(model=SONNET, messages=HELLO)
    r = await gateway.http.post("/v1/messages", headers={"Authorization": f"Bearer {key}"},
                                json={"model": SONNET, "max_tokens": 4, "messages": HELLO})
    assert r.status_code == 200 and r.json()["type"] == "message"
    r = await gateway.http.post("/v1/messages", headers={"x-api-key": key}, json={"model": SONNET, "messages": HELLO})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = await gateway.http.post("/v1/messages", headers={"x-api-key": gateway.admin_key},
                                json={"model": SONNET, "max_tokens": 4, "messages": HELLO})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"


# -- the prefix cache's tokens, priced: the real engine -----------------------------------------------
async def test_cached_tokens_are_read_back_and_priced_on_the_budget(model_gateway):
    gw = model_gateway
    t, key = await gw.tenant(cached_input_price=0.5, quota={"daily_token_budget": 1_000_000,
                                                            "tokens_per_minute": 1_000_000})
    c = client(gw, key)
    system = "You answer questions about the weather. " * 12          # a prefix of several blocks
    msgs = [{"role": "user", "content": "Is it raining?"}]
    first = await c.messages.create(model=SONNET, max_tokens=4, system=system, messages=msgs,
                                      extra_body={"temperature": 0})
    second = await c.messages.create(model=SONNET, max_tokens=4, system=system, messages=msgs,
                                      extra_body={"temperature": 0})
    assert first.usage.cache_read_input_tokens == 0
    cached = second.usage.cache_read_input_tokens
    prompt = second.usage.input_tokens + cached
    assert cached >= 64 and prompt == first.usage.input_tokens
    assert gw.engine.stats().tenants[t["id"]]["online"].cached_tokens == cached   # the engine's count
    u = await usage_of(gw, t["id"])
    assert (u["requests"], u["prompt_tokens"], u["cached_tokens"]) == (2, 2 * prompt, cached)
    charged = prompt + 4 + (prompt - cached) + -(-cached // 2) + 4
    assert u["budget_tokens"] == charged
    quota = (await gw.http.get("/v1/usage/quota", headers=gw.auth(key))).json()["data"][0]
    assert quota["cached_input_price"] == 0.5
    assert quota["limits"]["daily_token_budget"]["used"] == charged            # the limiter's state
    assert quota["limits"]["tokens_per_minute"]["used"] == 2 * (prompt + 4)    # every token


async def test_the_price_is_set_by_the_admin_and_checked(model_gateway):
    t, _ = await model_gateway.tenant()
    assert t["cached_input_price"] == 1.0 and t["model_aliases"] is None
    for bad in (1.5, -0.1, None, "half"):
        r = await model_gateway.admin.patch(f"/tenants/{t['id']}", json={"cached_input_price": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cached_input_price", (bad, r.text)
    r = await model_gateway.admin.patch(f"/tenants/{t['id']}", json={"cached_input_price": 0.25,
                                                                     "model_aliases": {"claude-opus-*": MODEL}})
    assert r.status_code == 200 and r.json()["cached_input_price"] == 0.25
    assert r.json()["model_aliases"] == {"claude-opus-*": MODEL}
    r = await model_gateway.admin.patch(f"/tenants/{t['id']}", json={"model_aliases": {"claude-x": "nonesuch"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model_aliases"


async def test_a_tenants_own_alias_is_its_own(model_gateway):
    _, key = await model_gateway.tenant(model_aliases={"house-model": MODEL})
    _, other = await model_gateway.tenant()
    m = await client(model_gateway, key).messages.create(model="house-model", max_tokens=2, messages=HELLO)
    assert m.model == "house-model" and m.usage.output_tokens == 2
    with pytest.raises(anthropic.NotFoundError):
        await client(model_gateway, other).messages.create(model="house-model", max_tokens=2, messages=HELLO)


async def test_aliases_exact_names_first_then_the_longest_pattern():
    table = [("claude-*", "a"), ("claude-3-5-haiku-*", "b"), ("claude-3-5-haiku-latest", "c")]
    assert alias_of("claude-3-5-haiku-latest", table) == "c"
    assert alias_of("claude-3-5-haiku-20241022", table) == "b"
    assert alias_of("claude-opus-4-1", table) == "a"
    assert alias_of("gpt-4o", table) is None
