"""Plans and overload at the gateway: the gateway in process with the real engine (its
admission bound is the behaviour under test) and the official `openai` client, on both
backends (SQLite + the in-process limiter, PostgreSQL + Redis).

The gateway's engine runs one sequence at a time (`max_num_seqs=1`) and queues at most
`max_waiting_tokens=4096` tokens, counting prompt + max_tokens of every request that has sent
nothing yet (engine/admission.py). Each overload test first starts a long flex stream, the
*hold*: 4 prompt tokens + 4092 output tokens (exactly the bound; it leaves the queue with its
first token and then runs for half a minute, more than the test needs), so that everything
sent after it stays queued until the test closes it. Prompts are token ids, so each
request's queue tokens are known exactly. Nothing below is timed.
"""

from __future__ import annotations

import asyncio
import re
import time

import openai
import pytest
import pytest_asyncio

from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "small"                 # llama small: a 4096-token context, ~7 ms per decode step on CPU
QUEUE_TOKENS = 4096             # max_waiting_tokens
HOLD_TOKENS = QUEUE_TOKENS - 4  # the hold's max_tokens: its 4-token prompt + this = the bound
FLEX = {"service_tier": "flex"}
ENGINE = {"kv_cache_memory": 64 << 20, "max_num_seqs": 1, "max_waiting_tokens": QUEUE_TOKENS}


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["embedded", "services"])
async def server(request, tmp_path_factory):
    models = {MODEL: demo_model("llama", "small", 0)}
    async with running_gateway(tmp_path_factory.mktemp(request.param), request.param, engine="real",
                               models=models, engine_kwargs=ENGINE) as gw:
        yield gw


def client(server, key) -> openai.AsyncOpenAI:
    return server.openai(key, timeout=120)


def ids(k: int, n: int = 4) -> list[int]:
    """Prompt k: n token ids, none special, distinct across prompts (no shared prefix)."""
    return [100 + (k * 97 + j) % 8000 for j in range(n)]


async def overload(server) -> dict:
    return (await server.admin.get("/engine")).json()["models"][MODEL]["overload"]


async def wait_queued(server, num: int, tokens: int) -> None:
    """Until the engine's queue holds `num` offline requests of `tokens` tokens in all."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        q = await overload(server)
        if (q["queued"]["offline"], q["queued_tokens"]) == (num, tokens):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"queue never held {num} requests / {tokens} tokens: {q}")


async def hold(c: openai.AsyncOpenAI):
    """The long flex stream, once it is running (its first token arrived)."""
    stream = await c.completions.create(model=MODEL, prompt=ids(0), max_tokens=HOLD_TOKENS, stream=True,
                                        extra_body={**FLEX, "ignore_eos": True})
    await anext(aiter(stream))
    return stream


async def refusals(server, tenant_name: str) -> dict[tuple[str, str], float]:
    """lockgate_overload_refusals_total of one tenant: (service_tier, reason) -> count."""
    out = {}
    for line in (await server.admin.get(server.url + "/metrics")).text.splitlines():
        if line.startswith("lockgate_overload_refusals_total{") and f'tenant="{tenant_name}"' in line:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out[(labels["service_tier"], labels["reason"])] = float(line.rsplit(" ", 1)[1])
    return out


async def usage_of(server, tenant_id: str, requests: int) -> dict:
    """The tenant's usage totals, once `requests` rows are in (10 s at most)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = (await server.admin.get("/usage", params={"tenant_id": tenant_id})).json()["data"]
        if rows and rows[0]["requests"] >= requests:
            return rows[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"usage rows of {tenant_id}: {rows}")


async def released(server) -> None:
    """Wait (10 s at most) until no request holds a lease and the KV cache is empty."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        eng = (await server.admin.get("/engine")).json()
        if eng["inflight_requests"] == 0 and eng["models"][MODEL]["kv_blocks"]["used"] == 0:
            break
        await asyncio.sleep(0.05)
    assert eng["inflight_requests"] == 0 and eng["models"][MODEL]["kv_blocks"]["used"] == 0
    assert sum(eng["models"][MODEL]["overload"]["queued"].values()) == 0


async def test_new_tenant_plan_is_default_and_flex_until_priority_is_granted(server):
    t, key = await server.tenant()
    assert t["service_tiers"] == ["default", "flex"] and t["default_tier"] == "default"
    c = client(server, key)
    msgs = [{"role": "user", "content": "plan"}]
    with pytest.raises(openai.PermissionDeniedError) as e:
        await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, service_tier="priority")
    assert e.value.code == "service_tier_not_allowed" and e.value.body["param"] == "service_tier"
    assert (await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                            service_tier="flex")).service_tier == "flex"

    r = await server.admin.patch(f"/tenants/{t['id']}",
                                 json={"service_tiers": ["default", "priority", "flex"]})
    assert r.status_code == 200 and r.json()["service_tiers"] == ["default", "priority", "flex"]
    r = await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, service_tier="priority")
    assert r.service_tier == "priority" and r.usage.completion_tokens == 2
    assert (await c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)).service_tier == "default"

    # granted at creation too
    _, key2 = await server.tenant(service_tiers=["priority", "default"])
    r = await client(server, key2).chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                                           service_tier="priority")
    assert r.service_tier == "priority"


async def test_flex_refused_then_shed_for_default_and_nothing_counted(server):
    """The queue after the hold starts, request by request (tokens = prompt + max_tokens):

        F2  flex, 2 prompts, JSON   2 x (4 + 1980) = 3968   queue 3968
        F3  flex, 1 prompt,  JSON        4 + 60   =   64    queue 4032
        S   flex, stream                 4 + 60   =   64    queue 4096: full
        F4  flex, JSON                   4 + 8    =   12    over by 12, nothing less urgent
                                                            than offline: refused -> 429
        D   default, JSON                4 + 100  =  104    over by 104: sheds the newest
            sheddable flex work, F3 (64, still over by 40) then F2's second prompt (1984).
            S is newer than both but a stream: never shed. D is admitted.

    F3 and F2 are answered 429 `resource_unavailable` (F2's first prompt, not shed, is
    closed by the gateway). Then the hold is closed and D and S complete. F2, F3 and F4
    were never billed: F2 and F3, shed from the queue, have a `cancelled` row of 0 tokens
    each (the usage rule for requests that end early), F4, refused at submit, none; and the
    tenant's 6 requests a minute still admit 3 more after the hold, S and D (had the
    refusals counted, none would pass)."""
    t, key = await server.tenant(quota={"requests_per_minute": 6})
    c = client(server, key)
    h = await hold(c)
    try:
        f2 = asyncio.ensure_future(c.completions.create(model=MODEL, prompt=[ids(1), ids(2)],
                                                        max_tokens=1980, extra_body=FLEX))
        await wait_queued(server, 2, 3968)
        f3 = asyncio.ensure_future(c.completions.create(model=MODEL, prompt=ids(3), max_tokens=60,
                                                        extra_body=FLEX))
        await wait_queued(server, 3, 4032)
        s = await c.completions.create(model=MODEL, prompt=ids(4), max_tokens=60, stream=True,
                                       extra_body=FLEX)
        await wait_queued(server, 4, 4096)
        with pytest.raises(openai.RateLimitError) as refused:
            await c.completions.create(model=MODEL, prompt=ids(5), max_tokens=8, extra_body=FLEX)
        d = asyncio.ensure_future(c.completions.create(model=MODEL, prompt=ids(6), max_tokens=100))
        shed = []
        for f in (f2, f3):
            with pytest.raises(openai.RateLimitError) as e:
                await asyncio.wait_for(f, 60)
            shed.append(e.value)
    finally:
        await h.close()
    answer = await asyncio.wait_for(d, 120)
    chunks = [ch async for ch in s]

    for exc in (refused.value, *shed):
        assert exc.code == "resource_unavailable", exc.body
        assert int(exc.response.headers["retry-after"]) >= 1
    assert answer.usage.completion_tokens >= 1 and answer.choices[0].finish_reason
    assert "".join(ch.choices[0].text for ch in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    q = await overload(server)
    assert q["refused"]["offline"] == {t["id"]: 1}
    assert q["shed"]["offline"] == {t["id"]: 2}          # F3 and F2's second prompt
    assert await refusals(server, t["name"]) == {("flex", "refused"): 1.0, ("flex", "shed"): 2.0}

    # the limiter: the hold, S and D took 3 of the 6; the refusals none
    for i in range(3):
        await c.completions.create(model=MODEL, prompt=ids(10 + i), max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        await c.completions.create(model=MODEL, prompt=ids(13), max_tokens=1)
    assert e.value.code == "rate_limit_exceeded"
    # usage: the hold (cancelled), S, D and the 3 after; F2 and F3 cancelled with 0 tokens;
    # no row for F4
    u = await usage_of(server, t["id"], 8)
    assert (u["requests"], u["ok"], u["cancelled"], u["errors"]) == (8, 5, 3, 0), u
    await released(server)


async def test_streams_are_never_shed_so_default_is_refused_with_503(server):
    """After the hold, two flex streams fill the queue: 2 x (1990 + 58) = 4096 tokens. A
    default request of 4 + 8 = 12 tokens is over the bound and nothing it may shed is
    queued (streams are not sheddable): 503 `engine_overloaded`, unbilled. Both streams,
    whose 200 went out at once, complete once the hold is closed."""
    t, key = await server.tenant(quota={"requests_per_minute": 4})
    c = client(server, key)
    h = await hold(c)
    try:
        streams = []
        for k in (1, 2):
            streams.append(await c.completions.create(model=MODEL, prompt=ids(k, 1990), max_tokens=58,
                                                      stream=True, extra_body=FLEX))
            await wait_queued(server, k, 2048 * k)
        with pytest.raises(openai.InternalServerError) as e:
            await c.completions.create(model=MODEL, prompt=ids(3), max_tokens=8)
    finally:
        await h.close()
    assert e.value.status_code == 503 and e.value.code == "engine_overloaded", e.value.body
    assert int(e.value.response.headers["retry-after"]) >= 1
    for s in streams:
        chunks = [ch async for ch in s]
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    q = await overload(server)
    assert q["refused"]["online"] == {t["id"]: 1} and t["id"] not in q["shed"]["offline"]
    assert await refusals(server, t["name"]) == {("default", "refused"): 1.0}
    # the hold and the two streams took 3 of the 4 requests a minute; the refusal none
    await c.completions.create(model=MODEL, prompt=ids(4), max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        await c.completions.create(model=MODEL, prompt=ids(5), max_tokens=1)
    u = await usage_of(server, t["id"], 4)
    assert (u["requests"], u["ok"], u["cancelled"], u["errors"]) == (4, 3, 1, 0), u
    await released(server)


async def test_gateway_refuses_flex_past_its_queue_time_and_the_engine_queues_the_rest(server):
    """The gateway's own bound on flex: while the engine's queued work takes longer than
    `flex_max_queue_s` to compute (its cost model), a flex request is answered 429
    `resource_unavailable` before it reaches the engine (the engine's refusals stay at 0;
    the gateway counts it). A default request is not subject to it and is served. With the
    bound lowered to a femtosecond, one queued flex stream (4 + 60 tokens) is enough."""
    t, key = await server.tenant(quota={"requests_per_minute": 10})
    c = client(server, key)
    settings = server.app.state.lockgate.settings
    h = await hold(c)
    try:
        s = await c.completions.create(model=MODEL, prompt=ids(1), max_tokens=60, stream=True,
                                       extra_body=FLEX)
        await wait_queued(server, 1, 64)
        deadline = time.monotonic() + 30
        while (await overload(server))["drain_s"] is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)          # the cost model is fitted within the hold's steps
        settings.flex_max_queue_s = 1e-15
        with pytest.raises(openai.RateLimitError) as refused:
            await c.completions.create(model=MODEL, prompt=ids(2), max_tokens=8, extra_body=FLEX)
        d = await c.completions.create(model=MODEL, prompt=ids(3), max_tokens=8)
    finally:
        settings.flex_max_queue_s = 30.0
        await h.close()
    assert refused.value.code == "resource_unavailable", refused.value.body
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert d.usage.completion_tokens == 8
    assert [ch async for ch in s][-1].choices[0].finish_reason in ("length", "stop")
    q = await overload(server)
    assert t["id"] not in q["refused"]["offline"] and t["id"] not in q["refused"]["online"]
    assert await refusals(server, t["name"]) == {("flex", "refused"): 1.0}
    await released(server)
