"""Budgets that survive losing Redis, through the app in this process (the fake engine) on real
PostgreSQL and a `redis-server` this file starts itself and restarts empty (kill -9).

The outside attack: a tenant with a daily budget of 2,000 tokens spent it (then 429s); Redis
was killed and restarted empty; the same key was served again as if nothing had been spent.
Now the first admission of the tag after the loss finds its epoch missing, the gateway
rebuilds the tag's day and month counters from the usage rows, and the budget holds: 429.
A request in flight across the restart is billed once (its row, not its lost reservation),
and losing one tag's keys (a Redis Cluster node restarting) rebuilds that tag only.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import openai
import pytest
import pytest_asyncio
import redis
from sqlalchemy import func, select

from lockgate.tenancy.models import UsageRecord
from tests.support.inprocess_gateway import InProcessGateway, running_gateway
from tests.support.own_redis import OwnRedis

pytestmark = pytest.mark.asyncio(loop_scope="module")

PREFIX = "lg-rebuild:"


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    srv = OwnRedis(tmp_path_factory.mktemp("redis"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory, own_redis):
    async with running_gateway(tmp_path_factory.mktemp("gw"), "services", redis_url=own_redis.url,
                               redis_prefix=PREFIX, redis_timeout_s=0.25) as g:
        yield g


def day_counter(own: OwnRedis, tenant_id: str) -> int:
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    client = redis.Redis(port=own.port, socket_timeout=2)
    try:
        return int(client.get(f"{PREFIX}{{tenant:{tenant_id}}}:day:{day}") or 0)
    finally:
        client.close()


async def rows_total(g: InProcessGateway, tenant_id: str) -> tuple[int, int]:
    """(rows, prompt + completion tokens) of the tenant's usage rows."""
    async with g.app.state.lockgate.sessions() as s:
        n, total = (await s.execute(
            select(func.count(), func.coalesce(func.sum(UsageRecord.prompt_tokens
                                                        + UsageRecord.completion_tokens), 0))
            .where(UsageRecord.tenant_id == tenant_id))).one()
    return int(n), int(total)


async def chat(c: openai.AsyncOpenAI, max_tokens: int = 40):
    return await c.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "spend"}], max_tokens=max_tokens,
        extra_body={"ignore_eos": True})


async def until_ready(g: InProcessGateway, seconds: float = 10.0) -> None:
    """The limiter answers again (the outage the restart started is over)."""
    deadline = time.monotonic() + seconds
    while (await g.http.get("/ready")).status_code != 200:
        assert time.monotonic() < deadline, "the gateway did not get its limiter back"
        await asyncio.sleep(0.05)


async def spend(c: openai.AsyncOpenAI) -> tuple[int, int]:
    """Requests until the budget refuses: (200s, then the 429s seen: 1)."""
    ok = 0
    for _ in range(200):
        try:
            await chat(c)
            ok += 1
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota", exc
            return ok, 1
    raise AssertionError("the budget never refused")


async def after_restart(g: InProcessGateway, c: openai.AsyncOpenAI, answers: int = 3) -> tuple[int, int]:
    """The next `answers` requests that the limiter decides (a 503 while the gateway has not
    got Redis back is retried): (served, refused for the budget)."""
    served = refused = 0
    deadline = time.monotonic() + 15
    while served + refused < answers:
        assert time.monotonic() < deadline, "the gateway did not get its limiter back"
        try:
            await chat(c)
            served += 1
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota"
            refused += 1
        except openai.InternalServerError:
            await asyncio.sleep(0.05)
    return served, refused


async def test_a_redis_restart_does_not_reset_a_spent_budget(gw, own_redis):
    t, key = await gw.tenant(quota={"daily_token_budget": 2000})
    c = gw.openai(key)
    ok, refused = await spend(c)
    n, billed = await rows_total(gw, t["id"])
    assert (ok, refused, n) == (ok, 1, ok) and ok > 1
    assert day_counter(own_redis, t["id"]) == billed
    own_redis.restart()                  # kill -9, then a fresh empty redis-server
    served_after, refused_after = await after_restart(gw, c)
    assert (served_after, refused_after) == (0, 3), \
        f"{served_after} requests served on a spent budget after the restart"
    assert await rows_total(gw, t["id"]) == (n, billed)
    assert day_counter(own_redis, t["id"]) == billed
    print(f"budget 2000: {ok} x 200 ({billed} tokens in rows), then 429; after the restart "
          f"{served_after} x 200, {refused_after} x 429; counter {day_counter(own_redis, t['id'])}")


async def test_a_request_in_flight_across_the_restart_is_billed_once(gw, own_redis):
    t, key = await gw.tenant(quota={"daily_token_budget": 100_000})
    c = gw.openai(key)
    await chat(c, 8)
    engine = gw.engine
    engine.token_interval_s = 0.05       # 30 tokens: 1.5 s, across the restart
    try:
        running = asyncio.ensure_future(chat(c, 30))
        await asyncio.sleep(0.4)
        own_redis.restart()
        r = await running
        assert r.http_response.status_code == 200
    finally:
        engine.token_interval_s = 0.0
    await until_ready(gw)
    await chat(c, 8)                      # an admission after the restart
    n, billed = await rows_total(gw, t["id"])
    assert n == 3
    assert day_counter(own_redis, t["id"]) == billed


async def test_losing_one_tags_keys_rebuilds_that_tag_only(gw, own_redis):
    spent, key = await gw.tenant(quota={"daily_token_budget": 300})
    other, other_key = await gw.tenant(quota={"daily_token_budget": 100_000})
    await spend(gw.openai(key))
    await chat(gw.openai(other_key))
    client = redis.Redis(port=own_redis.port, socket_timeout=2)
    try:
        lost = list(client.scan_iter(match=f"{PREFIX}{{tenant:{spent['id']}}}*"))
        assert lost
        client.delete(*lost)              # one Cluster node's slots, emptied
    finally:
        client.close()
    with pytest.raises(openai.RateLimitError) as e:
        await chat(gw.openai(key))
    assert e.value.code == "insufficient_quota"
    assert day_counter(own_redis, spent["id"]) == (await rows_total(gw, spent["id"]))[1]
    await chat(gw.openai(other_key))
    assert day_counter(own_redis, other["id"]) == (await rows_total(gw, other["id"]))[1]
