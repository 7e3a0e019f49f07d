"""A live `lockgate serve` on a Redis that hangs (issue 14, finding 1): a `redis-server` this
file starts on its own port and stops with SIGSTOP.

Closed (the default, `LOCKGATE_LIMITS_ON_REDIS_FAILURE=closed`): a new request gets 503
`limiter_unavailable` with Retry-After within about the timeout, `/ready` answers 503 with
`"limiter": "unavailable"` at once, and both recover after SIGCONT. A stream admitted before
the hang still ends with `[DONE]` and one usage row (its settlement queued). Open: the request
is admitted by the replica's in-process limiter (which enforces the quota), `/ready` says
"degraded", the outage is logged once and counted in `/metrics`.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pydantic
import pytest

from lockgate.gateway.settings import Settings
from tests.support.gateway_server import GatewayServer
from tests.support.own_redis import OwnRedis

TIMEOUT_S = "0.25"
BOUND = 1.5          # a refusal or a fallback admission must come within this, seconds


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    srv = OwnRedis(tmp_path_factory.mktemp("redis"))
    try:
        yield srv
    finally:
        srv.stop()


def start(tmp_path_factory, own_redis: OwnRedis, mode: str):
    return GatewayServer.start(tmp_path_factory.mktemp(f"gw-{mode}"), redis_url=own_redis.url,
                               redis_prefix=f"lg-{mode}:",
                               extra_env={"LOCKGATE_REDIS_TIMEOUT_S": TIMEOUT_S,
                                          "LOCKGATE_LIMITS_ON_REDIS_FAILURE": mode})


@pytest.fixture(scope="module")
def closed_server(tmp_path_factory, own_redis):
    srv = start(tmp_path_factory, own_redis, "closed")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory, own_redis):
    srv = start(tmp_path_factory, own_redis, "open")
    yield srv
    srv.stop()


@pytest.fixture
def hang(own_redis):
    """The Redis, to `pause()` (and `resume()`); it answers again after the test whatever happened."""
    yield own_redis
    own_redis.resume()


def client(srv: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=5)


def chat(c: openai.OpenAI):
    return c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def wait_until(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def limiter_ready(srv: GatewayServer, want: str) -> bool:
    return httpx.get(srv.url + "/ready", timeout=5).json().get("limiter") == want


def test_closed_a_new_request_gets_503_within_the_timeout_and_ready_reports_it(closed_server, hang):
    _, key = closed_server.tenant(quota={"requests_per_minute": 1000})
    c = client(closed_server, key)
    assert chat(c).http_response.status_code == 200
    hang.pause()
    t0 = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        chat(c)
    assert time.monotonic() - t0 < BOUND
    assert err.value.status_code == 503 and err.value.code == "limiter_unavailable"
    assert err.value.response.headers["retry-after"] == "1"
    t0 = time.monotonic()
    ready = httpx.get(closed_server.url + "/ready", timeout=5)
    assert time.monotonic() - t0 < BOUND
    assert ready.status_code == 503 and ready.json()["limiter"] == "unavailable", ready.text
    hang.resume()
    wait_until(lambda: limiter_ready(closed_server, "ok"))
    assert chat(c).http_response.status_code == 200


def test_a_stream_admitted_before_the_hang_ends_with_done_and_one_usage_row(closed_server, hang):
    _, key = closed_server.tenant(quota={"requests_per_minute": 1000})
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 48,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    lines: list[str] = []
    with httpx.stream("POST", closed_server.url + "/v1/chat/completions", json=body,
                      headers=headers, timeout=5) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if len(lines) == 1:
                    hang.pause()    # admitted and streaming: Redis stops answering now
    assert lines[-1] == "[DONE]"
    usage = [json.loads(x)["usage"] for x in lines[:-1] if json.loads(x).get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 48
    report = httpx.get(closed_server.url + "/v1/usage", headers=headers, timeout=5).json()
    assert sum(g["requests"] for g in report["data"]) == 1, report


def test_open_a_new_request_is_admitted_in_process_and_ready_says_degraded(open_server, hang):
    _, key = open_server.tenant(quota={"requests_per_minute": 2})
    c = client(open_server, key)
    hang.pause()
    t0 = time.monotonic()
    assert chat(c).http_response.status_code == 200
    assert time.monotonic() - t0 < BOUND
    assert chat(c).http_response.status_code == 200
    with pytest.raises(openai.RateLimitError):       # the replica's own limiter enforces rpm
        chat(c)
    ready = httpx.get(open_server.url + "/ready", timeout=5)
    assert ready.status_code == 200 and ready.json()["limiter"] == "degraded", ready.text
    metrics = open_server.admin.get(open_server.url + "/metrics", timeout=5).text
    assert 'lockgate_limiter_redis_events_total{event="outages"} 1.0' in metrics
    assert 'lockgate_limiter_redis_events_total{event="fallback_decisions"} 3.0' in metrics
    assert open_server.log().count("does not answer") == 1


@pytest.mark.parametrize("field, value", [("redis_timeout_s", 0), ("redis_timeout_s", -1),
                                          ("limits_on_redis_failure", "maybe"),
                                          ("limiter_max_queued_settlements", 0)])
def test_bad_limiter_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(pydantic.ValidationError, match=rf"{field}\n.*(must be|Input should be)"):
        Settings(**{field: value})


def test_the_limiter_settings_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCKGATE_REDIS_TIMEOUT_S", "0.1")
    monkeypatch.setenv("LOCKGATE_LIMITS_ON_REDIS_FAILURE", "open")
    monkeypatch.setenv("LOCKGATE_LIMITER_MAX_QUEUED_SETTLEMENTS", "5")
    s = Settings()
    assert (s.redis_timeout_s, s.limits_on_redis_failure, s.limiter_max_queued_settlements) == (0.1, "open", 5)
    assert Settings.model_fields["limits_on_redis_failure"].default == "closed"
