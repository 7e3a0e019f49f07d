"""Budgets rebuilt from the usage rows when Redis loses a tag (`limiter.rebuild`,
`limiter.redis_epoch`), on real PostgreSQL and Redis: the tag's keys deleted, as a Redis
Cluster node that restarted empty loses its slots.

What settles an admission from before the loss: its used tokens are charged once, unless the
rebuild already counted its row; a spooled row replayed after the rebuild is charged once when
nothing else charged it; with the database unreachable the tag is refused, never admitted on
counters read as zero. The gateway's own scenario is tests/gateway/test_budget_rebuild.py.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
import redis

from lockgate.tenancy import db as tdb
from lockgate.tenancy import tenants
from lockgate.tenancy.errors import LimiterUnavailable
from lockgate.tenancy.limiter import InProcessLimiter, LimitScope, RedisLimiter
from lockgate.tenancy.limiter.base import ReplayedRow
from lockgate.tenancy.limiter.rebuild import BudgetRebuilder
from lockgate.tenancy.models import UsageRecord
from lockgate.tenancy.quota import Quota


@pytest.fixture
async def sessions(pg_url):
    await tdb.upgrade_async(pg_url)
    engine = tdb.make_engine(pg_url)
    try:
        yield tdb.make_sessionmaker(engine)
    finally:
        await engine.dispose()


@pytest.fixture
async def limiter(sessions, redis_url, redis_prefix):
    lim = RedisLimiter(redis_url, prefix=redis_prefix, rebuilder=BudgetRebuilder(sessions, 5.0))
    yield lim
    await lim.close()


@pytest.fixture
async def tenant(sessions) -> str:
    async with sessions() as s:
        t = await tenants.create_tenant(s, name="rebuild", actor="key_0000000000000000")
        await s.commit()
    return t.id


def scope(tenant_id: str) -> LimitScope:
    return LimitScope(f"tenant:{tenant_id}", Quota(daily_token_budget=10_000, monthly_token_budget=50_000))


async def row(sessions, tenant_id: str, rid: str, tokens: int) -> None:
    async with sessions() as s, s.begin():
        s.add(UsageRecord(request_id=rid, tenant_id=tenant_id, api_key_id="key_x", model="tiny",
                          service_tier="default", prompt_tokens=tokens, cached_tokens=0,
                          completion_tokens=0, status="ok", queue_ms=0.0, ttft_ms=None,
                          total_ms=1.0, created_at=datetime.now(UTC)))


async def admit(lim, rid: str, s: LimitScope, tokens: int):
    d = await lim.acquire(rid, [s], tokens)
    assert d.allowed and d.lease is not None
    return d.lease


def lose(redis_url: str, prefix: str, tenant_id: str) -> None:
    """Every key of the tenant's tag gone (its Cluster node restarted empty)."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}{{tenant:{tenant_id}}}*"))
        assert keys
        client.delete(*keys)
    finally:
        client.close()


async def day(lim, s: LimitScope) -> int:
    return (await lim.usage(s))["day_tokens"]


async def test_a_settlement_from_before_the_loss_charges_its_tokens_once(
        limiter, sessions, tenant, redis_url, redis_prefix):
    s = scope(tenant)
    running = await admit(limiter, "a-running", s, 500)     # in flight across the loss
    ended = await admit(limiter, "b-ended", s, 400)
    await row(sessions, tenant, "b-ended", 100)
    await limiter.settle(ended, 100)
    assert await day(limiter, s) == 600
    lose(redis_url, redis_prefix, tenant)
    after = await admit(limiter, "c-after", s, 200)          # rebuilt first: b's row, then c
    assert await day(limiter, s) == 100 + 200
    assert after.epoch and after.epoch != running.epoch
    await row(sessions, tenant, "a-running", 300)             # its row after the rebuild
    await limiter.settle(running, 300)
    await limiter.settle(running, 300)                        # a settlement applied twice
    assert await day(limiter, s) == 100 + 200 + 300
    await row(sessions, tenant, "c-after", 150)
    await limiter.settle(after, 150)
    assert await day(limiter, s) == 100 + 300 + 150            # == the rows
    assert (await limiter.usage(s))["month_tokens"] == 550


async def test_a_settlement_whose_row_the_rebuild_counted_charges_nothing(
        limiter, sessions, tenant, redis_url, redis_prefix):
    s = scope(tenant)
    lost = await admit(limiter, "d-row-first", s, 400)
    await row(sessions, tenant, "d-row-first", 250)           # its row, then Redis lost
    lose(redis_url, redis_prefix, tenant)
    await admit(limiter, "e", s, 0)                           # rebuilt: d's row counted
    assert await day(limiter, s) == 250
    await limiter.settle(lost, 250)                            # its settlement, queued meanwhile
    assert await day(limiter, s) == 250
    await limiter.cancel(await admit(limiter, "f", s, 10))
    assert await day(limiter, s) == 250


async def test_a_row_replayed_after_the_rebuild_is_charged_once(
        limiter, sessions, tenant, redis_url, redis_prefix):
    s = scope(tenant)
    spooled = await admit(limiter, "g-spooled", s, 400)
    await limiter.settle(spooled, 180)                          # settled; its row in a spool
    created = datetime.now(UTC).timestamp()
    await asyncio.sleep(0.01)
    lose(redis_url, redis_prefix, tenant)                       # its charge lost with Redis
    await limiter.settle(await admit(limiter, "h", s, 0), 0)    # rebuilt: no row of g yet
    assert await day(limiter, s) == 0
    await row(sessions, tenant, "g-spooled", 180)               # the spool replayed
    replayed = ReplayedRow("g-spooled", tenant, "key_x", 180, created)
    assert await limiter.charge_replayed([replayed]) == 1
    assert await limiter.charge_replayed([replayed]) == 0       # replayed again: once
    await limiter.settle(spooled, 180)                           # its settlement again: nothing
    assert await day(limiter, s) == 180


async def test_without_the_database_a_lost_tag_is_refused_not_zeroed(redis_url, redis_prefix):
    engine = tdb.make_engine("postgresql+asyncpg://postgres@127.0.0.1:1/none")  # nothing listens
    lim = RedisLimiter(redis_url, prefix=redis_prefix,
                       rebuilder=BudgetRebuilder(tdb.make_sessionmaker(engine), 2.0))
    s = scope("t-db-down")
    try:
        with pytest.raises(LimiterUnavailable, match="cannot be rebuilt from the usage rows"):
            await lim.acquire("r1", [s], 10)
        client = redis.Redis.from_url(redis_url)
        try:
            assert list(client.scan_iter(match=f"{redis_prefix}{{tenant:t-db-down}}*")) == []
        finally:
            client.close()
    finally:
        await lim.close()
        await engine.dispose()


async def test_the_in_process_limiter_has_no_epoch_to_lose():
    lim = InProcessLimiter()
    s = scope("t-local")
    lease = await admit(lim, "r1", s, 100)
    assert lease.epoch == ""
    await lim.settle(lease, 40)
    assert await lim.charge_replayed([ReplayedRow("r1", "t-local", "k", 40, 0.0)]) == 0
    assert await day(lim, s) == 40


async def test_on_redis_cluster_one_tags_node_losing_it_rebuilds_that_tag(
        sessions, tenant, redis_cluster, cluster_prefix):
    """The rebuild, a stale settlement, a refund and its replayed row, each one script on the
    tag's slot; the other tag keeps its epoch and counters."""
    lim = RedisLimiter(redis_cluster.url, prefix=cluster_prefix, lease_ttl=0.3,
                       rebuilder=BudgetRebuilder(sessions, 5.0))
    other = scope("t-other")
    try:
        s = scope(tenant)
        running = await admit(lim, "a", s, 500)
        await lim.settle(await admit(lim, "o", other, 70), 70)
        await row(sessions, tenant, "b", 100)
        await lim.settle(await admit(lim, "b", s, 100), 100)
        for port in redis_cluster.ports:       # the tag's node, emptied of the tag's slot
            node = redis.Redis(host="127.0.0.1", port=port)
            try:
                keys = list(node.scan_iter(match=f"{cluster_prefix}{{tenant:{tenant}}}*"))
                if keys:
                    node.delete(*keys)
            finally:
                node.close()
        died = await admit(lim, "c", s, 50)                      # rebuilt: b's row
        assert await day(lim, s) == 100 + 50
        await lim.settle(running, 300)                           # no row yet: charged
        await row(sessions, tenant, "a", 300)
        assert await day(lim, s) == 100 + 50 + 300
        await asyncio.sleep(0.4)                                 # c's replica died
        assert await lim.abandon(died) is True                   # refunded: no row
        assert await day(lim, s) == 100 + 300
        await row(sessions, tenant, "c", 40)                     # its row, replayed
        assert await lim.charge_replayed([ReplayedRow("c", tenant, "key_x", 40, 0.0)]) == 1
        assert await day(lim, s) == 100 + 300 + 40              # == the rows
        assert (await lim.usage(other))["day_tokens"] == 70     # the other tag: untouched
    finally:
        await lim.close()


async def test_a_lost_registry_is_refilled_so_a_dead_replicas_admissions_are_found(
        limiter, sessions, tenant, redis_url, redis_prefix):
    """Redis restarted empty loses the registry of tags with the tag's keys: the admission
    that rebuilds the tag registers it again at once, and a registry lost alone (its Cluster
    node) is noticed by the next `expired` pass; either way an admission whose process dies
    afterwards is found when its lease runs out."""
    s = scope(tenant)
    registry = redis_prefix + "pending-tags"
    client = redis.Redis.from_url(redis_url)
    try:
        await admit(limiter, "reg-0", s, 10)
        lose(redis_url, redis_prefix, tenant)
        client.delete(registry)
        await admit(limiter, "reg-1", s, 10)        # rebuilds the tag: registered again
        assert [t async for t, _ in _zscan(client, registry)] == [f"tenant:{tenant}".encode()]
        client.delete(registry)                    # the registry alone is lost
        await limiter.expired()                    # noticed: the tag is registered again
        assert [t async for t, _ in _zscan(client, registry)] == [f"tenant:{tenant}".encode()]
        dead = RedisLimiter(redis_url, prefix=redis_prefix, lease_ttl=0.3,
                            rebuilder=BudgetRebuilder(sessions, 5.0))
        try:
            await admit(dead, "reg-2", s, 10)       # a replica that dies without settling
        finally:
            await dead.close()
        await asyncio.sleep(0.5)
        assert "reg-2" in {lease.request_id for lease in await limiter.expired()}
    finally:
        client.close()


async def _zscan(client, key):
    for member in client.zscan_iter(key):
        yield member
