"""The limiter's two-step admission (`acquire` with 0 tokens, then `reserve`) and its
reconciler operations (`expired`, `abandon`), on both backends where both apply.

The gateway counts a request and takes its concurrency lease before it reads the body (so a
tenant's 1 MB prompts are rate-limited before they are parsed), then reserves the tokens once
the prompt is tokenized. A process that dies leaves its admissions unsettled: the Redis
limiter keeps an index of them, `expired` finds those whose lease ran out, and the reconciler
settles each to its usage row or `abandon`s it (refunding its reservation).
"""

from __future__ import annotations

import asyncio

import pytest

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.limiter import InProcessLimiter, RedisLimiter
from tests.tenancy.test_limiter import Backend, redis_of, scope


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend(request):
    b = Backend(request.param, *redis_of(request, request.param))
    yield b
    for lim in b.made:
        await lim.close()


LIMITS = {"requests_per_minute": 3, "tokens_per_minute": 1000, "max_concurrent_requests": 2,
          "daily_token_budget": 5000}


async def test_two_steps_count_the_request_first_then_its_tokens(backend):
    lim = backend()
    s = scope(**LIMITS)
    d = await lim.acquire("r1", [s], 0)
    assert d.allowed and d.lease is not None and d.lease.reserved_tokens == 0
    u = await lim.usage(s)
    assert (u["requests_in_window"], u["concurrent"], u["tokens_in_window"], u["day_tokens"]) == (1, 1, 0, 0)
    r = await lim.reserve(d.lease, 400)
    assert r.allowed and r.lease is not None and r.lease.reserved_tokens == 400
    assert r.lease.request_id == "r1" and r.lease.day == d.lease.day
    assert r.remaining_tokens == 600 and r.remaining_requests == 2   # headers after the reserve
    u = await lim.usage(s)
    assert (u["requests_in_window"], u["tokens_in_window"], u["day_tokens"]) == (1, 400, 400)
    await lim.settle(r.lease, 250)
    u = await lim.usage(s)
    assert (u["requests_in_window"], u["concurrent"], u["tokens_in_window"], u["day_tokens"]) == (1, 0, 250, 250)


async def test_a_refused_reserve_changes_nothing_and_the_request_still_counts(backend):
    lim = backend()
    s = scope(**LIMITS)
    held = await lim.acquire("r0", [s], 900)
    assert held.allowed
    d = await lim.acquire("r1", [s], 0)
    assert d.allowed and d.lease is not None
    before = await lim.usage(s)
    r = await lim.reserve(d.lease, 200)                      # 900 + 200 > 1000 per minute
    assert not r.allowed and r.lease is None
    assert r.code == "rate_limit_exceeded" and r.limit == "tokens_per_minute"
    assert r.retry_after is not None and r.retry_after > 0
    assert await lim.usage(s) == before
    never = await lim.reserve(d.lease, 1001)                # more than the limit itself
    assert not never.allowed and never.retry_after is None
    # the gateway then settles the admission to 0: the request keeps its rate count (as
    # OpenAI counts failed requests), its lease is freed, no token is charged
    await lim.settle(d.lease, 0)
    u = await lim.usage(s)
    assert (u["requests_in_window"], u["concurrent"], u["tokens_in_window"], u["day_tokens"]) == (2, 1, 900, 900)


async def test_reserve_is_refused_by_the_daily_budget(backend):
    lim = backend()
    s = scope(daily_token_budget=100)
    d = await lim.acquire("r1", [s], 0)
    assert d.allowed and d.lease is not None
    r = await lim.reserve(d.lease, 101)
    assert not r.allowed and r.code == "insufficient_quota" and r.limit == "daily_token_budget"
    r = await lim.reserve(d.lease, 60)
    assert r.allowed and r.lease is not None
    d2 = await lim.acquire("r2", [s], 0)
    assert d2.allowed and d2.lease is not None
    r2 = await lim.reserve(d2.lease, 60)                      # 60 + 60 > 100
    assert not r2.allowed and r2.retry_after is not None and r2.retry_after > 0
    assert (await lim.usage(s))["day_tokens"] == 60


async def test_reserve_after_the_end_is_invalid(backend):
    lim = backend()
    s = scope(**LIMITS)
    d = await lim.acquire("r1", [s], 0)
    assert d.lease is not None
    await lim.settle(d.lease, 0)
    with pytest.raises(Invalid, match="no longer unsettled"):
        await lim.reserve(d.lease, 10)
    with pytest.raises(Invalid, match="tokens"):
        await lim.reserve(d.lease, -1)


async def test_unlimited_scopes_reserve_without_a_round_trip(backend):
    lim = backend()
    from lockgate.tenancy.limiter import LimitScope
    from lockgate.tenancy.quota import Quota
    free = LimitScope("tenant:free", Quota())
    d = await lim.acquire("r1", [free], 0)
    assert d.lease is not None
    r = await lim.reserve(d.lease, 10**6)
    assert r.allowed and r.lease is not None and r.lease.reserved_tokens == 10**6


async def test_in_process_admissions_never_expire_into_the_reconciler():
    lim = InProcessLimiter(lease_ttl=0.01)
    d = await lim.acquire("r1", [scope(**LIMITS)], 10)
    assert d.lease is not None
    await asyncio.sleep(0.05)
    assert await lim.expired() == []
    assert await lim.abandon(d.lease) is False


# -- the reconciler's operations, on Redis -------------------------------------------------------


@pytest.fixture(params=["redis", "cluster"])
async def redis_lim(request):
    """Makes Redis limiters (one node, then the Cluster) on a prefix of the test's own."""
    redis_url, redis_prefix = redis_of(request, request.param)
    lims: list[RedisLimiter] = []

    def make(**kw) -> RedisLimiter:
        lim = RedisLimiter(redis_url, prefix=redis_prefix, **kw)
        lims.append(lim)
        return lim

    yield make
    for lim in lims:
        await lim.close()


async def test_expired_finds_an_unheartbeaten_admission_and_abandon_refunds_it(redis_lim):
    dead = redis_lim(lease_ttl=0.3)           # the replica that dies
    alive = redis_lim(lease_ttl=0.3)          # the one that reconciles
    s, k = scope(**LIMITS), scope("key:k1", "tenant:t1", requests_per_minute=10)
    d = await dead.acquire("r1", [s, k], 0)
    assert d.lease is not None
    r = await dead.reserve(d.lease, 300)
    assert r.lease is not None
    assert await alive.expired() == []        # its lease still runs
    await asyncio.sleep(0.4)
    found = await alive.expired()
    assert [x.request_id for x in found] == ["r1"]
    lease = found[0]
    assert lease.reserved_tokens == 300 and lease.day == d.lease.day and lease.month == d.lease.month
    assert {x.key: x.quota for x in lease.scopes} == {x.key: x.quota for x in (s, k)}
    assert await alive.abandon(lease) is True
    u = await alive.usage(s)
    assert (u["requests_in_window"], u["concurrent"], u["tokens_in_window"], u["day_tokens"]) == (1, 0, 0, 0)
    assert await alive.expired() == []        # out of the index
    assert await alive.abandon(lease) is False
    # the process was alive after all and settles what it used: charged in full, once
    await dead.settle(r.lease, 120)
    await dead.settle(r.lease, 120)
    u = await alive.usage(s)
    assert (u["tokens_in_window"], u["day_tokens"]) == (120, 120)


async def test_a_heartbeat_keeps_an_admission_out_of_the_reconciler(redis_lim):
    lim = redis_lim(lease_ttl=0.3)
    s = scope(**LIMITS)
    d = await lim.acquire("r1", [s], 50)
    assert d.lease is not None
    for _ in range(3):
        await asyncio.sleep(0.15)
        await lim.heartbeat([d.lease])
    assert await lim.expired() == []
    await asyncio.sleep(0.4)
    found = await lim.expired()
    assert [x.request_id for x in found] == ["r1"]
    # a heartbeat lands between `expired` and `abandon`: abandon declines, nothing refunded
    await lim.heartbeat([d.lease])
    assert await lim.abandon(found[0]) is False
    assert (await lim.usage(s))["day_tokens"] == 50
    await lim.settle(d.lease, 40)
    assert (await lim.usage(s))["day_tokens"] == 40


async def test_cancel_after_abandon_refunds_nothing_twice(redis_lim):
    lim = redis_lim(lease_ttl=0.2)
    s = scope(**LIMITS)
    d = await lim.acquire("r1", [s], 70)
    assert d.lease is not None
    await asyncio.sleep(0.3)
    (lease,) = await lim.expired()
    assert await lim.abandon(lease)
    await lim.cancel(d.lease)
    u = await lim.usage(s)
    assert (u["requests_in_window"], u["day_tokens"]) == (0, 0)   # out of the window, not -70


async def test_an_end_charges_what_redis_holds_not_a_stale_lease(redis_lim):
    """A reserve that ran on Redis but whose reply was lost (a timeout): the caller still holds
    the lease of 0 tokens and settles or cancels with it. Redis's own record of the
    reservation decides what comes off the budgets, so nothing stays charged."""
    lim = redis_lim()
    s = scope(daily_token_budget=5000)
    d = await lim.acquire("r1", [s], 0)
    assert (await lim.reserve(d.lease, 300)).allowed       # its reply "lost": d.lease is stale
    await lim.settle(d.lease, 40)
    assert (await lim.usage(s))["day_tokens"] == 40
    d2 = await lim.acquire("r2", [s], 0)
    assert (await lim.reserve(d2.lease, 200)).allowed
    await lim.cancel(d2.lease)
    assert (await lim.usage(s))["day_tokens"] == 40


async def test_an_admission_whose_marker_expired_leaves_the_index(redis_lim):
    """Its marker gone (older than PENDING_TTL): abandon declines, and drops it from the
    pending index so that it does not take the reconciler's batch on every pass."""
    lim = redis_lim(lease_ttl=0.2)
    s = scope(**LIMITS)
    d = await lim.acquire("r1", [s], 10)
    assert d.lease is not None
    await asyncio.sleep(0.3)
    (lease,) = await lim.expired()
    from lockgate.tenancy.limiter.redis_keys import marker
    await lim._redis.execute("DEL", marker(lim.prefix, "tenant:t1", "r1"))   # as if it expired
    assert await lim.abandon(lease) is False
    assert await lim.expired() == []
