"""The gateway in process (the fake engine) on a Redis that hangs: a `redis-server` this file
starts on its own port and stops with SIGSTOP.

Closed (the default, `LOCKGATE_LIMITS_ON_REDIS_FAILURE=closed`): a new request gets 503
`limiter_unavailable` with Retry-After within about the timeout, `/ready` answers 503 with
`"limiter": "unavailable"` at once, and both recover after SIGCONT. A stream admitted before
the hang still ends with `[DONE]` and one usage row (its settlement queued). Open: the request
is admitted by the replica's in-process limiter (which enforces the quota), `/ready` says
"degraded", the outage is logged once and counted in `/metrics`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import openai
import pydantic
import pytest
import pytest_asyncio

from lockgate.gateway.settings import Settings
from tests.support.inprocess_gateway import InProcessGateway, running_gateway
from tests.support.own_redis import OwnRedis

pytestmark = pytest.mark.asyncio(loop_scope="module")

TIMEOUT_S = 0.25
BOUND = 1.5          # a refusal or a fallback admission must come within this, seconds


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    srv = OwnRedis(tmp_path_factory.mktemp("redis"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(request, tmp_path_factory, own_redis):
    """A gateway limiting on the Redis, `closed` or `open` on its failure (the test's indirect
    parameter): one at a time, the first stopped before the second starts, so that the log
    captured (WARNING and up) is the one gateway's."""
    mode = request.param
    async with running_gateway(tmp_path_factory.mktemp(f"gw-{mode}"), redis_url=own_redis.url,
                               redis_prefix=f"lg-{mode}:", redis_timeout_s=TIMEOUT_S,
                               limits_on_redis_failure=mode, log_level=logging.WARNING) as gw:
        yield gw


closed = pytest.mark.parametrize("server", ["closed"], indirect=True)
open_ = pytest.mark.parametrize("server", ["open"], indirect=True)


@pytest.fixture
def hang(own_redis):
    """The Redis, to `pause()` (and `resume()`); it answers again after the test whatever happened."""
    yield own_redis
    own_redis.resume()


def client(srv: InProcessGateway, key: str) -> openai.AsyncOpenAI:
    return srv.openai(key, timeout=5)


async def chat(c: openai.AsyncOpenAI):
    return await c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


async def wait_until(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not await predicate():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


async def limiter_ready(srv: InProcessGateway, want: str) -> bool:
    return (await srv.http.get("/ready", timeout=5)).json().get("limiter") == want


@closed
async def test_closed_a_new_request_gets_503_within_the_timeout_and_ready_reports_it(server, hang):
    _, key = await server.tenant(quota={"requests_per_minute": 1000})
    c = client(server, key)
    assert (await chat(c)).http_response.status_code == 200
    hang.pause()
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        await chat(c)
    assert time.monotonic() - t0 < BOUND
    assert err.value.status_code == 503 and err.value.code == "limiter_unavailable"
    assert err.value.response.headers["retry-after"] == "1"
    t0 = time.monotonic()
    ready = await server.http.get("/ready", timeout=5)
    assert time.monotonic() - t0 < BOUND
    assert ready.status_code == 503 and ready.json()["limiter"] == "unavailable", ready.text
    hang.resume()
    await wait_until(lambda: limiter_ready(server, "ok"))
    assert (await chat(c)).http_response.status_code == 200


@closed
async def test_a_stream_admitted_before_the_hang_ends_with_done_and_one_usage_row(server, hang):
    _, key = await server.tenant(quota={"requests_per_minute": 1000})
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 48,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    lines: list[str] = []
    async with server.http.stream("POST", "/v1/chat/completions", json=body, headers=headers, timeout=5) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1:
                    hang.pause()    # admitted and streaming: Redis stops answering now
    assert lines[-1] == "[DONE]"
    usage = [json.loads(x)["usage"] for x in lines[:-1] if json.loads(x).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 48
    report = (await server.http.get("/v1/usage", headers=headers, timeout=5)).json()
    assert sum(g["requests"] for g in report["data"]) == 1, report


@open_
async def test_open_a_new_request_is_admitted_in_process_and_ready_says_degraded(server, hang):
    _, key = await server.tenant(quota={"requests_per_minute": 2})
    c = client(server, key)
    hang.pause()
    t0 = time.monotonic()
    assert (await chat(c)).http_response.status_code == 200
    assert time.monotonic() - t0 < BOUND
    assert (await chat(c)).http_response.status_code == 200
    with pytest.raises(openai.RateLimitError):       # the replica's own limiter enforces rpm
        await chat(c)
    ready = await server.http.get("/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["limiter"] == "degraded", ready.text
    metrics = (await server.admin.get(server.url + "/metrics", timeout=5)).text
    assert 'lockgate_limiter_redis_events_total{event="outages"} 1.0' in metrics
    assert 'lockgate_limiter_redis_events_total{event="fallback_decisions"} 3.0' in metrics
    assert server.log().count("does not answer") == 1


@pytest.mark.parametrize("field, value", [("redis_timeout_s", 0), ("redis_timeout_s", -1),
                                          ("limits_on_redis_failure", "maybe"),
                                          ("limiter_max_queued_settlements", 0)])
async def test_bad_limiter_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(pydantic.ValidationError, match=rf"{field}\n.*(must be|Input should be)"):
        Settings(**{field: value})


async def test_the_limiter_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCKGATE_REDIS_TIMEOUT_S", "0.1")
    monkeypatch.setenv("LOCKGATE_LIMITS_ON_REDIS_FAILURE", "open")
    monkeypatch.setenv("LOCKGATE_LIMITER_MAX_QUEUED_SETTLEMENTS", "5")
    s = Settings()
    assert (s.redis_timeout_s, s.limits_on_redis_failure, s.limiter_max_queued_settlements) == (0.1, "open", 5)
    assert Settings.model_fields["limits_on_redis_failure"].default == "closed"
