"""A replica's own admission bounds, checked before the shared limiter is asked (the gateway
in process, both backends): a tenant whose plan sets no concurrency gets
`default_max_concurrent_requests`, refused 429 on this replica once its requests here reach
it; and past `max_admissions_in_flight` admissions under way, any request is refused 503
`server_busy` with Retry-After. Neither refusal costs a limiter call.
"""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="module")
GATEWAY_OPTIONS = {"default_max_concurrent_requests": 2, "max_admissions_in_flight": 4}
HOLD = {"model": "tiny", "messages": [{"role": "user", "content": "hold"}], "max_tokens": 2000,
        "ignore_eos": True, "stream": True}
SMALL = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.fixture
def acquires(gateway, monkeypatch) -> list[str]:
    """The request id of every limiter acquire, in order."""
    limiter = gateway.app.state.lockgate.limiter
    real = limiter.acquire
    calls: list[str] = []

    async def counted(request_id, *args, **kwargs):
        calls.append(request_id)
        return await real(request_id, *args, **kwargs)

    monkeypatch.setattr(limiter, "acquire", counted)
    return calls


async def test_a_tenant_without_a_concurrency_gets_the_default_refused_before_the_limiter(gateway, acquires):
    _, key = await gateway.tenant()
    _, own = await gateway.tenant(quota={"max_concurrent_requests": 3})
    async with gateway.http.stream("POST", "/v1/chat/completions", json=HOLD, headers=gateway.auth(key)) as one, \
            gateway.http.stream("POST", "/v1/chat/completions", json=HOLD, headers=gateway.auth(key)) as two:
        assert one.status_code == two.status_code == 200
        assert (await anext(one.aiter_lines())).startswith("data: ")
        assert (await anext(two.aiter_lines())).startswith("data: ")
        before = len(acquires)
        r = await gateway.http.post("/v1/chat/completions", json=SMALL, headers=gateway.auth(key))
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert "max_concurrent_requests" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        assert len(acquires) == before                    # no limiter call for it
        # a plan's own concurrency wins over the default
        async with gateway.http.stream("POST", "/v1/chat/completions", json=HOLD,
                                       headers=gateway.auth(own)) as a, \
                gateway.http.stream("POST", "/v1/chat/completions", json=HOLD,
                                    headers=gateway.auth(own)) as b:
            assert a.status_code == b.status_code == 200
            r = await gateway.http.post("/v1/chat/completions", json=SMALL, headers=gateway.auth(own))
            assert r.status_code == 200, r.text
    # the streams ended: their places are free again
    r = await gateway.http.post("/v1/chat/completions", json=SMALL, headers=gateway.auth(key))
    assert r.status_code == 200, r.text
    assert gateway.app.state.lockgate.inflight.under_way == 0


async def test_past_the_replicas_admissions_under_way_a_503_before_the_limiter(gateway, monkeypatch):
    state = gateway.app.state.lockgate
    keys = [(await gateway.tenant())[1] for _ in range(5)]
    real = state.limiter.acquire
    gate = asyncio.Event()
    waiting: list[str] = []

    async def slow(request_id, *args, **kwargs):
        waiting.append(request_id)
        await gate.wait()                 # the limiter (Redis) answers late
        return await real(request_id, *args, **kwargs)

    monkeypatch.setattr(state.limiter, "acquire", slow)
    held = [asyncio.ensure_future(gateway.http.post("/v1/chat/completions", json=SMALL,
                                                    headers=gateway.auth(k))) for k in keys[:4]]
    while len(waiting) < 4:
        await asyncio.sleep(0.01)
    r = await gateway.http.post("/v1/chat/completions", json=SMALL, headers=gateway.auth(keys[4]))
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "server_busy" and r.headers["retry-after"] == "1"
    assert len(waiting) == 4
    gate.set()
    assert [x.status_code for x in await asyncio.gather(*held)] == [200] * 4
    assert state.inflight.under_way == 0 and not state.inflight.pending
    r = await gateway.http.post("/v1/chat/completions", json=SMALL, headers=gateway.auth(keys[4]))
    assert r.status_code == 200, r.text
