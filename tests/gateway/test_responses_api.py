"""OpenAI's Responses API with the official `openai` client, the gateway in process with the
fake served engine, on both backends (SQLite + the in-process limiter; PostgreSQL + Redis):
the Response object and its usage, the event stream, a function call round trip through
`previous_response_id`, stored responses per tenant (GET, input items, DELETE, `store: false`,
retention), one usage row per answer, and the 400s naming the field. (What the model writes
under `text.format`: test_responses_model.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import timedelta

import openai
import pytest
from sqlalchemy import func, select, update

from lockgate.tenancy import stored_responses
from lockgate.tenancy.models import StoredResponse, UsageRecord, utcnow
from tests.support.fake_served_engine import SENTENCE

pytestmark = pytest.mark.asyncio(loop_scope="module")

# the runner's loop sweeps expired responses on each round (test_retention_...)
GATEWAY_OPTIONS = {"batch_poll_s": 0.2, "file_sweep_interval_s": 0.2}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}]
CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'


@contextlib.contextmanager
def answering(gateway, text: str):
    """The fake engine answers `text`, exactly, then stops (a forced call's JSON, say)."""
    saved = [(e._answer_ids, e._pieces, e.eos_after) for e in gateway.engines]
    for e in gateway.engines:
        ids = e.tokenizer.encode(text, add_special_tokens=False)
        e._set_answer(e.tokenizer, ids)
        e.eos_after = len(ids)
    try:
        yield
    finally:
        for e, (ids, pieces, eos_after) in zip(gateway.engines, saved, strict=True):
            e._answer_ids, e._pieces, e.eos_after = ids, pieces, eos_after


async def count(gateway, model, *conds) -> int:
    async with gateway.app.state.lockgate.sessions() as s:
        return (await s.execute(select(func.count()).select_from(model).where(*conds))).scalar_one()


async def usage_rows(gateway, response_id: str) -> list[UsageRecord]:
    async with gateway.app.state.lockgate.sessions() as s:
        rows = await s.execute(select(UsageRecord).where(UsageRecord.request_id == response_id.removeprefix("resp_")))
        return list(rows.scalars())


async def test_create_answers_text_with_usage_and_one_usage_row(gateway, tenant):
    t, key = tenant
    c = gateway.openai(key)
    r = await c.responses.create(model="tiny", input="Hello", instructions="Be brief.", service_tier="flex")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert r.model == "tiny" and r.service_tier == "flex" and r.instructions == "Be brief."
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert SENTENCE.startswith(r.output_text[:40]) and len(r.output_text) > 40
    [row] = await usage_rows(gateway, r.id)
    assert (row.status, row.service_tier, row.tenant_id) == ("ok", "flex", t["id"])
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == \
        (row.prompt_tokens, row.completion_tokens, row.prompt_tokens + row.completion_tokens)
    assert u.input_tokens_details.cached_tokens == row.cached_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert (await c.responses.retrieve(r.id)).model_dump() == r.model_dump()
    cut = await c.responses.create(model="tiny", input="Hello", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and len(await usage_rows(gateway, cut.id)) == 1


async def test_stream_sends_openai_events_in_order_then_one_row(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    async with c.responses.stream(model="tiny", input="Hi") as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and final.status == "completed"
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    [row] = await usage_rows(gateway, final.id)
    assert row.completion_tokens == final.usage.output_tokens > 0
    assert (await c.responses.retrieve(final.id)).output_text == text


async def test_function_call_round_trip_through_previous_response_id(gateway, tenant):
    """A forced call comes back as a function_call item (whole and streamed); its output sent
    with `previous_response_id` continues the stored conversation."""
    _, key = tenant
    c = gateway.openai(key)
    with answering(gateway, CALL):
        r1 = await c.responses.create(model="tiny", input="Weather in Paris?", tools=TOOLS, tool_choice="required")
        async with c.responses.stream(model="tiny", input="Weather in Paris?", tools=TOOLS,
                                      tool_choice={"type": "function", "name": "get_weather"}) as stream:
            kinds = [e.type async for e in stream]
            streamed = await stream.get_final_response()
    [call] = r1.output
    assert (call.type, call.name, json.loads(call.arguments), call.status) == \
        ("function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and r1.status == "completed"
    assert streamed.output[0].name == "get_weather" and streamed.output[0].arguments == call.arguments
    assert kinds[2] == "response.output_item.added" and "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    r2 = await c.responses.create(model="tiny", previous_response_id=r1.id, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}])
    assert r2.status == "completed" and r2.previous_response_id == r1.id and r2.output[0].type == "message"
    # the stored conversation came first: r1's input and its call, then the call's output
    assert r2.usage.input_tokens > r1.usage.input_tokens + r1.usage.output_tokens
    # an output must answer a call of the conversation
    with pytest.raises(openai.BadRequestError) as e:
        await c.responses.create(model="tiny", input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "x"}])
    assert e.value.body["param"] == "input[0].call_id"


async def test_another_tenants_response_is_404_everywhere(gateway, tenant):
    _, key = tenant
    _, other_key = await gateway.tenant()
    r = await gateway.openai(key).responses.create(model="tiny", input="mine")
    other = gateway.openai(other_key)
    with pytest.raises(openai.NotFoundError) as e:
        await other.responses.create(model="tiny", input="theirs?", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    for call in (other.responses.retrieve(r.id), other.responses.input_items.list(r.id),
                 other.responses.delete(r.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await gateway.openai(key).responses.retrieve(r.id)).id == r.id      # still there


async def test_store_false_stores_nothing_and_still_bills_once(gateway):
    t, key = await gateway.tenant()
    c = gateway.openai(key)
    r = await c.responses.create(model="tiny", input="forget me", store=False)
    s = await c.responses.create(model="tiny", input="forget me too", store=False, stream=True)
    streamed = [e async for e in s]
    assert r.store is False and streamed[-1].type == "response.completed"
    assert await count(gateway, StoredResponse, StoredResponse.tenant_id == t["id"]) == 0
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.create(model="tiny", input="again", previous_response_id=r.id)
    assert len(await usage_rows(gateway, r.id)) == 1
    assert len(await usage_rows(gateway, streamed[-1].response.id)) == 1


async def test_deleted_response_is_404(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    r = await c.responses.create(model="tiny", input="short-lived")
    gone = await c.responses.delete(r.id)
    assert gone is None or getattr(gone, "deleted", True)
    for call in (c.responses.retrieve(r.id), c.responses.delete(r.id), c.responses.input_items.list(r.id),
                 c.responses.create(model="tiny", input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            await call


async def test_input_items_are_listed_in_pages(gateway, tenant):
    _, key = tenant
    c = gateway.openai(key)
    given = [{"role": "developer", "content": "Answer in French."},
             {"role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]},
             {"type": "message", "role": "assistant", "content": "Salut"},
             {"role": "user", "content": "Ça va ?"}]
    r = await c.responses.create(model="tiny", input=given)
    page = await c.responses.input_items.list(r.id)           # newest first, as OpenAI's
    assert [i.role for i in page.data] == ["user", "assistant", "user", "developer"]
    assert page.data[0].content[0].text == "Ça va ?" and page.has_more is False
    asc = await c.responses.input_items.list(r.id, order="asc", limit=2)
    assert [i.role for i in asc.data] == ["developer", "user"] and asc.has_more is True
    rest = await c.responses.input_items.list(r.id, order="asc", after=asc.data[-1].id)
    assert [i.id for i in asc.data + rest.data] == [i.id for i in reversed(page.data)]
    assert [i.id async for i in c.responses.input_items.list(r.id, order="asc", limit=1)] == \
        [i.id for i in reversed(page.data)]
    bad = await gateway.http.get(f"/v1/responses/{r.id}/input_items", params={"after": "msg_nope"},
                                 headers=gateway.auth(key))
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


async def test_retention_expiry_is_404_then_swept(gateway):
    """Past its retention a response answers 404 at once; the runner's loop deletes it."""
    t, key = await gateway.tenant()
    c = gateway.openai(key)
    old, young = [await c.responses.create(model="tiny", input=f"r{i}") for i in range(2)]
    async with gateway.app.state.lockgate.sessions() as s:
        await s.execute(update(StoredResponse).where(StoredResponse.id == old.id)
                        .values(expires_at=utcnow() - timedelta(seconds=1)))
        await s.commit()
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(old.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.create(model="tiny", input="x", previous_response_id=old.id)
    for _ in range(100):        # the sweep runs every 0.2 s here
        if await count(gateway, StoredResponse, StoredResponse.id == old.id) == 0:
            break
        await asyncio.sleep(0.1)
    assert await count(gateway, StoredResponse, StoredResponse.tenant_id == t["id"]) == 1
    assert (await c.responses.retrieve(young.id)).id == young.id
    expected = utcnow() + timedelta(seconds=gateway.settings.responses_retention_s)
    async with gateway.app.state.lockgate.sessions() as s:
        row = await stored_responses.get_response(s, response_id=young.id, tenant_id=t["id"])
    assert abs((row.expires_at - expected).total_seconds()) < 120


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": {}, "text": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}, "input[1].role"),
    ({"input": [{"type": "function_call", "call_id": "c\x00", "name": "f", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": "x", "previous_response_id": "resp_\x00"}, "previous_response_id"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10_000_000}, "input"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}},
     "text.format.schema"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": ""}, "input"),
    ({"input": "x", "frobnicate": 1}, "frobnicate"),
])
async def test_bad_bodies_are_400_naming_the_field(gateway, tenant, body, param):
    _, key = tenant
    r = await gateway.http.post("/v1/responses", headers=gateway.auth(key), json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


async def test_nul_in_a_path_id_or_query_is_400(gateway, tenant):
    _, key = tenant
    for method, path, param in (("GET", "/v1/responses/resp_%00", "response_id"),
                                ("DELETE", "/v1/responses/resp_%00", "response_id"),
                                ("GET", "/v1/responses/resp_%00/input_items", "response_id"),
                                ("GET", "/v1/responses/resp_1/input_items?after=a%00b", "after")):
        r = await gateway.http.request(method, path, headers=gateway.auth(key))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_a_client_leaving_mid_stream_leaves_one_cancelled_row_and_nothing_stored(gateway):
    t, key = await gateway.tenant()
    aborted = sum(e.num_aborted for e in gateway.engines)
    before = [e.token_interval_s for e in gateway.engines]
    for e in gateway.engines:
        e.token_interval_s = 0.02         # still running when the client leaves
    try:
        async with gateway.http.stream("POST", "/v1/responses", headers=gateway.auth(key),
                                       json={"model": "tiny", "input": "long", "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("event: response.output_text.delta"):
                    break
        for _ in range(100):
            if await count(gateway, UsageRecord, UsageRecord.tenant_id == t["id"]):
                break
            await asyncio.sleep(0.05)
    finally:
        for e, interval in zip(gateway.engines, before, strict=True):
            e.token_interval_s = interval
    async with gateway.app.state.lockgate.sessions() as s:
        rows = list((await s.execute(select(UsageRecord).where(UsageRecord.tenant_id == t["id"]))).scalars())
    assert [row.status for row in rows] == ["cancelled"] and rows[0].completion_tokens < 64
    assert sum(e.num_aborted for e in gateway.engines) == aborted + 1
    assert await count(gateway, StoredResponse, StoredResponse.tenant_id == t["id"]) == 0


async def test_sampling_fields_reach_the_engine_and_limits_apply(gateway):
    """The chat path's translation: temperature, top_p and max_output_tokens are the
    engine's; the tenant's request rate holds as for chat (the SDK's RateLimitError)."""
    _, key = await gateway.tenant(quota={"requests_per_minute": 2})
    c = gateway.openai(key)
    r = await c.responses.create(model="tiny", input="x", temperature=0.25, top_p=0.5, max_output_tokens=7)
    request_id = r.id.removeprefix("resp_")
    [params] = [p for e in gateway.engines for rid, p, _ in e.submitted if rid.startswith(request_id)]
    assert (params.temperature, params.top_p, params.max_tokens, params.n) == (0.25, 0.5, 7, 1)
    await c.responses.create(model="tiny", input="y", max_output_tokens=1)
    with pytest.raises(openai.RateLimitError):
        await c.responses.create(model="tiny", input="z", max_output_tokens=1)


async def test_a_response_the_database_cannot_store_is_503_or_response_failed(gateway, monkeypatch):
    """The store's failure path: the answer is refused (503; in a stream `response.failed`),
    the work's one usage row stands, nothing is kept."""
    from sqlalchemy.exc import OperationalError

    async def down(*args, **kwargs):
        raise OperationalError("INSERT INTO stored_responses", {}, OSError("connection refused"))

    t, key = await gateway.tenant()
    monkeypatch.setattr(stored_responses, "store_response", down)
    r = await gateway.http.post("/v1/responses", headers=gateway.auth(key), json={"model": "tiny", "input": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
    stream = await gateway.openai(key).responses.create(model="tiny", input="x", stream=True)
    events = [e async for e in stream]
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "database_unavailable"
    assert "response.completed" not in [e.type for e in events]
    async with gateway.app.state.lockgate.sessions() as s:
        rows = list((await s.execute(select(UsageRecord).where(UsageRecord.tenant_id == t["id"]))).scalars())
    assert sorted(row.status for row in rows) == ["ok", "ok"]
    assert await count(gateway, StoredResponse, StoredResponse.tenant_id == t["id"]) == 0
