"""The lease reconciler (`gateway.reconciler`) on real PostgreSQL and Redis: admissions of
requests that died with their process are settled to their usage rows, or refunded when they
have none, so that budgets charge exactly what the rows show.

The replica is a plain namespace holding what `reconcile_once` reads of `AppState` (the
limiter, the session factory, its in-flight leases and its settings); the limiter, the
database and the rows are real. A live replica killed with kill -9 is the chaos test's.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from lockgate.gateway.reconciler import reconcile_once
from lockgate.tenancy import db as tdb
from lockgate.tenancy import tenants
from lockgate.tenancy.limiter import LimitScope, RedisLimiter
from lockgate.tenancy.models import UsageRecord
from lockgate.tenancy.quota import Quota

TTL = 0.3


@pytest.fixture
async def sessions(pg_url):
    await tdb.upgrade_async(pg_url)
    engine = tdb.make_engine(pg_url)
    try:
        yield tdb.make_sessionmaker(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def limiter(redis_url, redis_prefix):
    lim = RedisLimiter(redis_url, prefix=redis_prefix, lease_ttl=TTL)
    yield lim
    await lim.close()


async def row(sessions, tenant_id: str, request_id: str, prompt: int, completion: int) -> None:
    async with sessions() as s, s.begin():
        s.add(UsageRecord(request_id=request_id, tenant_id=tenant_id, api_key_id="key_x",
                          model="tiny", service_tier="default", prompt_tokens=prompt,
                          cached_tokens=0, completion_tokens=completion, status="ok",
                          queue_ms=0.0, ttft_ms=None, total_ms=1.0, created_at=datetime.now(UTC)))


async def admit(lim, rid: str, scope: LimitScope, tokens: int):
    d = await lim.acquire(rid, [scope], 0)
    r = await lim.reserve(d.lease, tokens)
    assert r.allowed and r.lease is not None
    return r.lease


async def test_dead_admissions_are_settled_to_their_rows_or_refunded(sessions, limiter):
    async with sessions() as s:
        t = await tenants.create_tenant(s, name="recon", actor="key_0000000000000000")
        await s.commit()
    scope = LimitScope(f"tenant:{t.id}", Quota(max_concurrent_requests=5, daily_token_budget=10_000))
    ended = await admit(limiter, "r-ended", scope, 300)     # its row was written, not its settle
    await row(sessions, t.id, "r-ended", 20, 100)
    await admit(limiter, "r-died", scope, 200)              # died before its row
    alive = await admit(limiter, "r-alive", scope, 100)     # this replica's own, running
    replica = SimpleNamespace(limiter=limiter, sessions=sessions, inflight={"r-alive": alive},
                              settings=SimpleNamespace(database_timeout_s=5.0))
    assert await reconcile_once(replica) == {"settled": 0, "abandoned": 0, "skipped": 0}
    assert (await limiter.usage(scope))["day_tokens"] == 600
    await asyncio.sleep(TTL + 0.1)                           # no heartbeat: every lease ran out
    assert await reconcile_once(replica) == {"settled": 1, "abandoned": 1, "skipped": 0}
    u = await limiter.usage(scope)
    # the row's 120, and the live request's reservation; the dead one's 200 refunded
    assert u["day_tokens"] == 120 + 100 and u["concurrent"] == 0
    # another replica does not know r-alive is alive (its replica stopped heart-beating):
    # it refunds it as dead; the ended request's own late settle changes nothing (settled)
    other = SimpleNamespace(limiter=limiter, sessions=sessions, inflight={},
                            settings=SimpleNamespace(database_timeout_s=5.0))
    assert await reconcile_once(other) == {"settled": 0, "abandoned": 1, "skipped": 0}
    await limiter.settle(ended, 120)
    assert (await limiter.usage(scope))["day_tokens"] == 120
    # r-alive was alive after all: it ends and is charged what it used, in full, once
    await limiter.settle(alive, 40)
    await limiter.settle(alive, 40)
    assert (await limiter.usage(scope))["day_tokens"] == 160
    assert await limiter.expired() == []


async def test_nothing_is_decided_while_the_database_is_unreachable(limiter, redis_prefix):
    engine = tdb.make_engine("postgresql://postgres@127.0.0.1:1/none")   # nothing listens there
    scope = LimitScope("tenant:t-db-down", Quota(daily_token_budget=1000))
    try:
        await admit(limiter, "r1", scope, 250)
        await asyncio.sleep(TTL + 0.1)
        replica = SimpleNamespace(limiter=limiter, sessions=tdb.make_sessionmaker(engine),
                                  inflight={}, settings=SimpleNamespace(database_timeout_s=2.0))
        assert await reconcile_once(replica) == {"settled": 0, "abandoned": 0, "skipped": 0}
        assert (await limiter.usage(scope))["day_tokens"] == 250    # a row may exist: kept
        assert [x.request_id for x in await limiter.expired()] == ["r1"]
    finally:
        await engine.dispose()
