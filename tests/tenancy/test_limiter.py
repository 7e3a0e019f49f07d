"""The limiter (`tenancy.limiter`): same semantics in-process and on Redis.

Tests parametrized over ``backend`` run three times: in-process with a fake clock, on the real
Redis of `tests.support.services`, and on a three-node Redis Cluster of the session
(`tests.support.redis_cluster`; both in real time, a key prefix unique to the test). Time travel
(window expiry, day/month rollover) uses the in-process limiter's fake clock; Redis is checked on
counts, atomicity, short lease expiry and exactness across OS processes, on one node and on
Cluster. As in the gateway, an API key's scope is in its tenant's tag (`LimitScope.tag`), so
that one request's keys are in one Cluster slot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import time
from datetime import UTC, datetime

import pytest

from lockgate.tenancy.errors import LimiterUnavailable
from lockgate.tenancy.limiter import (
    CONCURRENCY_RETRY_HINT,
    InProcessLimiter,
    Lease,
    Limiter,
    LimitScope,
    RedisLimiter,
    make_limiter,
)
from lockgate.tenancy.quota import Quota

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC).timestamp()


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Backend:
    """Makes limiters of one kind for a test and closes them afterwards."""

    def __init__(self, kind: str, redis_url: str | None = None, prefix: str | None = None) -> None:
        self.kind = kind
        self.redis_url = redis_url
        self.prefix = prefix
        self.clock = FakeClock()
        self.made: list[Limiter] = []

    def __call__(self, **kw) -> Limiter:
        if self.kind in ("redis", "cluster"):
            # these tests are about the limiter's semantics, not its time bound (the bound's
            # own tests build their limiters with it): a loaded 2-core CI machine can take
            # longer than the default 0.25 s to open a burst of connections (seen: 100
            # concurrent calls' connects to a Cluster node timing out)
            kw.setdefault("timeout", 5.0)
            lim: Limiter = RedisLimiter(self.redis_url, prefix=self.prefix, **kw)
        else:
            lim = InProcessLimiter(clock=self.clock, **kw)
        self.made.append(lim)
        return lim

    async def sleep(self, seconds: float) -> None:
        """Let time pass: really on Redis, on the fake clock in-process."""
        if self.kind in ("redis", "cluster"):
            await asyncio.sleep(seconds)
        else:
            self.clock.advance(seconds)


def redis_of(request, kind: str) -> tuple[str | None, str | None]:
    """The URL and a key prefix unique to the test, of one Redis node or of the Cluster
    (none in-process)."""
    if kind == "memory":
        return None, None
    if kind == "cluster":
        return (request.getfixturevalue("redis_cluster").url,
                request.getfixturevalue("cluster_prefix"))
    return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend(request):
    b = Backend(request.param, *redis_of(request, request.param))
    yield b
    for lim in b.made:
        await lim.close()


@pytest.fixture(params=["redis", "cluster"])
def redis_kind(request):
    """(URL, prefix) of one Redis node, then of the Cluster."""
    return redis_of(request, request.param)


@pytest.fixture
async def mem():
    b = Backend("memory")
    yield b
    for lim in b.made:
        await lim.close()


def scope(key: str = "tenant:t1", tag: str | None = None, **limits) -> LimitScope:
    return LimitScope(key, Quota(**limits), tag)


# --------------------------------------------------------------------------------------------
# requests per minute
# --------------------------------------------------------------------------------------------


async def test_rpm_exact_under_concurrency(backend):
    lim = backend()
    s = scope(requests_per_minute=10)
    ds = await asyncio.gather(*(lim.acquire(f"r{i}", [s], 5) for i in range(25)))
    allowed = [d for d in ds if d.allowed]
    refused = [d for d in ds if not d.allowed]
    assert len(allowed) == 10 and len(refused) == 15
    assert sorted(d.remaining_requests for d in allowed) == list(range(10))
    for d in allowed:
        assert d.lease is not None and d.code is None and d.limit_requests == 10
        assert d.limit_tokens is None and d.remaining_tokens is None
        # room for one more right away, except after the 10th admission
        assert (d.reset_requests == 0.0) == (d.remaining_requests > 0)
    for d in refused:
        assert d.lease is None
        assert d.code == "rate_limit_exceeded"
        assert d.limit == "requests_per_minute" and d.scope == "tenant:t1"
        assert 0 < d.retry_after <= 60
        assert "requests_per_minute" in d.message and "10" in d.message
        assert d.limit_requests == 10 and d.remaining_requests == 0
        assert 0 < d.reset_requests <= 60
    u = await lim.usage(s)
    assert u["requests_in_window"] == 10 and u["tokens_in_window"] == 50


async def test_rpm_window_slides_exactly(mem):
    lim = mem()
    s = scope(requests_per_minute=3)
    for i, t in enumerate((0, 20, 40)):
        mem.clock.now = T0 + t
        assert (await lim.acquire(f"r{i}", [s], 0)).allowed
    mem.clock.now = T0 + 50
    d = await lim.acquire("r3", [s], 0)
    assert not d.allowed and d.retry_after == pytest.approx(10.0)
    mem.clock.now = T0 + 60  # the entry of T0 leaves the window now
    d = await lim.acquire("r4", [s], 0)
    assert d.allowed and d.remaining_requests == 0
    assert d.reset_requests == pytest.approx(20.0)  # the entry of T0+20 leaves at T0+80
    mem.clock.now = T0 + 61
    d = await lim.acquire("r5", [s], 0)
    assert not d.allowed and d.retry_after == pytest.approx(19.0)
    assert (await lim.usage(s))["requests_in_window"] == 3


async def test_headers_report_the_tightest_scope(backend):
    lim = backend()
    tenant = scope("tenant:t1", requests_per_minute=10, tokens_per_minute=10_000)
    key = scope("key:k1", "tenant:t1", requests_per_minute=3)
    d = await lim.acquire("r1", [tenant, key], 400)
    assert d.allowed
    assert (d.limit_requests, d.remaining_requests) == (3, 2)
    assert (d.limit_tokens, d.remaining_tokens, d.reset_tokens) == (10_000, 9_600, 0.0)


# --------------------------------------------------------------------------------------------
# tokens per minute
# --------------------------------------------------------------------------------------------


async def test_tpm_reservation_and_settlement(backend):
    lim = backend()
    s = scope(tokens_per_minute=1000)
    d1 = await lim.acquire("r1", [s], 600)
    assert d1.allowed and d1.remaining_tokens == 400 and d1.limit_tokens == 1000
    d2 = await lim.acquire("r2", [s], 600)
    assert not d2.allowed
    assert (d2.code, d2.limit) == ("rate_limit_exceeded", "tokens_per_minute")
    assert 0 < d2.retry_after <= 60 and d2.remaining_tokens == 400
    assert (await lim.usage(s))["tokens_in_window"] == 600

    await lim.settle(d1.lease, 100)  # used fewer than reserved: room frees up
    assert (await lim.usage(s))["tokens_in_window"] == 100
    d3 = await lim.acquire("r3", [s], 600)
    assert d3.allowed and d3.remaining_tokens == 300

    await lim.settle(d3.lease, 900)  # used more than reserved: counts more
    u = await lim.usage(s)
    assert u["tokens_in_window"] == 1000 and u["requests_in_window"] == 2
    d4 = await lim.acquire("r4", [s], 1)
    assert not d4.allowed and d4.limit == "tokens_per_minute"
    assert d4.remaining_tokens == 0 and d4.reset_tokens > 0


async def test_tpm_window_expiry_and_late_settlement(mem):
    lim = mem()
    s = scope(tokens_per_minute=1000)
    d1 = await lim.acquire("r1", [s], 700)
    mem.clock.advance(30)
    d2 = await lim.acquire("r2", [s], 300)
    assert d2.allowed and d2.reset_tokens == pytest.approx(30.0)  # d1 leaves at T0+60
    d3 = await lim.acquire("r3", [s], 500)
    assert not d3.allowed and d3.retry_after == pytest.approx(30.0)
    mem.clock.advance(30)  # r1 has left the window
    assert (await lim.usage(s))["tokens_in_window"] == 300
    # settling r1 now must not bring its entry back into the window
    await lim.settle(d1.lease, 900)
    assert (await lim.usage(s))["tokens_in_window"] == 300
    assert (await lim.acquire("r4", [s], 700)).allowed


async def test_never_fits_is_refused_with_no_retry(backend):
    lim = backend()
    s = scope(tokens_per_minute=1000, daily_token_budget=5000)
    d = await lim.acquire("r1", [s], 1001)
    assert not d.allowed
    assert (d.code, d.limit, d.retry_after) == ("rate_limit_exceeded", "tokens_per_minute", None)
    assert "never" in d.message and "1001" in d.message and "1000" in d.message
    b = scope("tenant:b", daily_token_budget=500)
    d = await lim.acquire("r2", [b], 501)
    assert (d.allowed, d.code, d.limit, d.retry_after) == (
        False, "insufficient_quota", "daily_token_budget", None)
    assert "never" in d.message
    z = scope("tenant:z", requests_per_minute=0)
    d = await lim.acquire("r3", [z], 0)
    assert not d.allowed and d.retry_after is None and d.reset_requests is None
    # nothing was counted anywhere
    assert (await lim.usage(s)) == {"requests_in_window": 0, "tokens_in_window": 0,
                                    "concurrent": 0, "day_tokens": 0, "month_tokens": 0}


# --------------------------------------------------------------------------------------------
# atomicity across scopes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("refuse_with", ["requests_per_minute", "daily_token_budget"])
async def test_all_or_nothing_across_scopes(backend, refuse_with):
    lim = backend()
    a = scope("tenant:a", requests_per_minute=100, tokens_per_minute=100_000,
              max_concurrent_requests=10, daily_token_budget=100_000,
              monthly_token_budget=1_000_000)
    if refuse_with == "requests_per_minute":
        b = scope("key:b", "tenant:a", requests_per_minute=1)
    else:
        b = scope("key:b", "tenant:a", daily_token_budget=150)
    first = await lim.acquire("pre", [b], 100)  # fills B
    assert first.allowed
    before_b = await lim.usage(b)

    d = await lim.acquire("r1", [a, b], 100)
    assert not d.allowed and d.scope == "key:b" and d.limit == refuse_with
    assert d.code == ("insufficient_quota" if refuse_with == "daily_token_budget"
                      else "rate_limit_exceeded")
    assert await lim.usage(a) == {"requests_in_window": 0, "tokens_in_window": 0,
                                  "concurrent": 0, "day_tokens": 0, "month_tokens": 0}
    assert await lim.usage(b) == before_b
    # A alone still admits, and counts everything
    d = await lim.acquire("r2", [a], 100)
    assert d.allowed
    assert await lim.usage(a) == {"requests_in_window": 1, "tokens_in_window": 100,
                                  "concurrent": 1, "day_tokens": 100, "month_tokens": 100}


# --------------------------------------------------------------------------------------------
# concurrency leases
# --------------------------------------------------------------------------------------------


async def test_settle_releases_concurrency(backend):
    lim = backend()
    s = scope(max_concurrent_requests=2)
    d1, d2 = [await lim.acquire(f"r{i}", [s], 10) for i in (1, 2)]
    assert d1.allowed and d2.allowed
    d3 = await lim.acquire("r3", [s], 10)
    assert not d3.allowed
    assert (d3.code, d3.limit) == ("rate_limit_exceeded", "max_concurrent_requests")
    assert 0 < d3.retry_after <= CONCURRENCY_RETRY_HINT
    assert "max_concurrent_requests" in d3.message and "2" in d3.message
    await lim.settle(d1.lease, 5)
    assert (await lim.usage(s))["concurrent"] == 1
    assert (await lim.acquire("r3", [s], 10)).allowed
    assert (await lim.usage(s))["concurrent"] == 2


async def test_settle_is_idempotent(backend):
    lim = backend()
    s = scope(max_concurrent_requests=5, tokens_per_minute=10_000, daily_token_budget=10_000,
              monthly_token_budget=100_000)
    d1 = await lim.acquire("r1", [s], 1000)
    d2 = await lim.acquire("r2", [s], 1000)
    await lim.settle(d1.lease, 200)
    after_first = await lim.usage(s)
    assert after_first == {"requests_in_window": 2, "tokens_in_window": 1200, "concurrent": 1,
                           "day_tokens": 1200, "month_tokens": 1200}
    await lim.settle(d1.lease, 200)
    await lim.settle(d1.lease, 50)  # a different amount changes nothing either
    assert await lim.usage(s) == after_first
    await lim.settle(d2.lease, 1000)
    assert (await lim.usage(s))["concurrent"] == 0
    # request ids are unique: a settled one still in the window cannot be admitted again
    with pytest.raises(ValueError, match="request_id"):
        await lim.acquire("r1", [s], 10)
    assert (await lim.usage(s))["requests_in_window"] == 2


async def test_expired_lease_frees_its_slot_and_heartbeat_keeps_it(mem):
    lim = mem(lease_ttl=30)
    s = scope(max_concurrent_requests=1)
    d1 = await lim.acquire("r1", [s], 0)
    assert d1.allowed
    for _ in range(4):  # 80 s alive thanks to heartbeats every 20 s
        mem.clock.advance(20)
        await lim.heartbeat([d1.lease])
        d = await lim.acquire("x", [s], 0)
        assert not d.allowed and d.limit == "max_concurrent_requests"
    mem.clock.advance(29.9)
    assert not (await lim.acquire("y", [s], 0)).allowed
    mem.clock.advance(0.2)  # 30 s after the last heartbeat: the replica is presumed dead
    assert (await lim.usage(s))["concurrent"] == 0
    # a heartbeat after expiry does not bring the lease back
    await lim.heartbeat([d1.lease])
    d2 = await lim.acquire("r2", [s], 0)
    assert d2.allowed
    await lim.settle(d1.lease, 0)  # the late settlement of r1 must not free r2's slot
    assert (await lim.usage(s))["concurrent"] == 1


async def test_lease_expiry_and_heartbeat_on_redis(redis_kind):
    redis_url, redis_prefix = redis_kind
    lim = RedisLimiter(redis_url, prefix=redis_prefix, lease_ttl=1.0)
    try:
        s = scope(max_concurrent_requests=1)
        d1 = await lim.acquire("r1", [s], 0)
        assert d1.allowed
        for _ in range(4):  # 1.2 s alive thanks to heartbeats
            await asyncio.sleep(0.3)
            await lim.heartbeat([d1.lease])
            assert not (await lim.acquire("x", [s], 0)).allowed
        await asyncio.sleep(1.2)  # no heartbeat: expired
        assert (await lim.usage(s))["concurrent"] == 0
        await lim.heartbeat([d1.lease])
        d2 = await lim.acquire("r2", [s], 0)
        assert d2.allowed
        await lim.settle(d1.lease, 0)
        assert (await lim.usage(s))["concurrent"] == 1
    finally:
        await lim.close()


# --------------------------------------------------------------------------------------------
# daily and monthly budgets
# --------------------------------------------------------------------------------------------


async def test_daily_budget_refuses_until_midnight(mem):
    lim = mem()
    s = scope(daily_token_budget=1000)
    mem.clock.now = datetime(2026, 11, 29, 23, 0, 0, tzinfo=UTC).timestamp()
    d1 = await lim.acquire("r1", [s], 800)
    assert d1.allowed and d1.lease.day == "2026-11-29" and d1.lease.month == "2026-11"
    d2 = await lim.acquire("r2", [s], 300)
    assert not d2.allowed
    assert (d2.code, d2.limit, d2.scope) == ("insufficient_quota", "daily_token_budget",
                                             "tenant:t1")
    assert d2.retry_after == pytest.approx(3600.0)
    assert "daily_token_budget" in d2.message and "1000" in d2.message
    assert (await lim.acquire("r3", [s], 200)).allowed  # exactly fills the budget
    assert not (await lim.acquire("r4", [s], 1)).allowed
    mem.clock.now = datetime(2026, 11, 30, 0, 0, 0, tzinfo=UTC).timestamp()
    assert (await lim.acquire("r5", [s], 1000)).allowed


async def test_settlement_adjusts_the_day_of_the_reservation(mem):
    lim = mem()
    s = scope(daily_token_budget=1000, monthly_token_budget=10_000)
    mem.clock.now = datetime(2026, 11, 30, 23, 59, 50, tzinfo=UTC).timestamp()
    d1 = await lim.acquire("r1", [s], 800)
    assert (d1.lease.day, d1.lease.month) == ("2026-11-30", "2026-11")
    mem.clock.now = datetime(2026, 12, 1, 0, 0, 10, tzinfo=UTC).timestamp()  # new day and month
    d2 = await lim.acquire("r2", [s], 500)
    assert d2.allowed and d2.lease.day == "2026-12-01"
    await lim.settle(d1.lease, 100)
    u = await lim.usage(s)
    assert (u["day_tokens"], u["month_tokens"]) == (500, 500)  # today's counters untouched
    mem.clock.now = datetime(2026, 11, 30, 23, 59, 55, tzinfo=UTC).timestamp()  # look back
    u = await lim.usage(s)
    assert (u["day_tokens"], u["month_tokens"]) == (100, 100)


async def test_monthly_budget_refuses_until_next_month(mem):
    lim = mem()
    s = scope(monthly_token_budget=1000)
    mem.clock.now = datetime(2026, 12, 31, 12, 0, 0, tzinfo=UTC).timestamp()
    assert (await lim.acquire("r1", [s], 1000)).allowed
    d = await lim.acquire("r2", [s], 1)
    assert (d.code, d.limit) == ("insufficient_quota", "monthly_token_budget")
    assert d.retry_after == pytest.approx(12 * 3600.0)
    mem.clock.now = datetime(2027, 1, 1, 0, 0, 0, tzinfo=UTC).timestamp()
    assert (await lim.acquire("r3", [s], 1000)).allowed


async def test_budgets_on_redis(redis_kind):
    redis_url, redis_prefix = redis_kind
    lim = RedisLimiter(redis_url, prefix=redis_prefix)
    try:
        s = scope(daily_token_budget=1000, monthly_token_budget=100_000)
        d1 = await lim.acquire("r1", [s], 800)
        assert d1.allowed
        today = datetime.now(UTC)
        assert d1.lease.day == today.strftime("%Y-%m-%d")
        assert d1.lease.month == today.strftime("%Y-%m")
        d2 = await lim.acquire("r2", [s], 300)
        assert (d2.allowed, d2.code, d2.limit) == (False, "insufficient_quota",
                                                   "daily_token_budget")
        midnight = datetime(today.year, today.month, today.day, tzinfo=UTC).timestamp() + 86400
        assert d2.retry_after == pytest.approx(midnight - time.time(), abs=5)
        await lim.settle(d1.lease, 500)
        u = await lim.usage(s)
        assert (u["day_tokens"], u["month_tokens"]) == (500, 500)
        d3 = await lim.acquire("r3", [s], 300)
        assert d3.allowed
        await lim.settle(d3.lease, 450)  # more than reserved
        u = await lim.usage(s)
        assert (u["day_tokens"], u["month_tokens"]) == (950, 950)
    finally:
        await lim.close()


# --------------------------------------------------------------------------------------------
# cancellation (the engine refused an admitted request)
# --------------------------------------------------------------------------------------------

ZERO = {"requests_in_window": 0, "tokens_in_window": 0, "concurrent": 0, "day_tokens": 0,
        "month_tokens": 0}


def full(key: str = "tenant:t1") -> LimitScope:
    return scope(key, requests_per_minute=10, tokens_per_minute=10_000,
                 max_concurrent_requests=5, daily_token_budget=100_000,
                 monthly_token_budget=1_000_000)


async def test_cancel_undoes_the_admission(backend):
    """Another request (300 tokens, settled at 200) is counted before and after; r1 reserves
    500 in both scopes and its cancellation takes all of it back out, everywhere."""
    lim = backend()
    tenant, key = full("tenant:t1"), scope("key:k1", "tenant:t1", requests_per_minute=5)
    other = await lim.acquire("other", [tenant], 300)
    await lim.settle(other.lease, 200)
    before = await lim.usage(tenant), await lim.usage(key)
    assert before == ({"requests_in_window": 1, "tokens_in_window": 200, "concurrent": 0,
                       "day_tokens": 200, "month_tokens": 200},
                      ZERO)
    d = await lim.acquire("r1", [tenant, key], 500)
    assert d.allowed
    assert await lim.usage(tenant) == {"requests_in_window": 2, "tokens_in_window": 700,
                                       "concurrent": 1, "day_tokens": 700, "month_tokens": 700}
    assert (await lim.usage(key))["requests_in_window"] == 1
    await lim.cancel(d.lease)
    assert (await lim.usage(tenant), await lim.usage(key)) == before


async def test_cancel_frees_the_rpm_slot_settle_does_not(backend):
    lim = backend()
    s = scope(requests_per_minute=1)
    d1 = await lim.acquire("r1", [s], 10)
    assert not (await lim.acquire("r2", [s], 10)).allowed
    await lim.cancel(d1.lease)       # never counted: the slot is free again
    d2 = await lim.acquire("r2", [s], 10)
    assert d2.allowed
    await lim.settle(d2.lease, 10)   # did work: stays in the window
    d3 = await lim.acquire("r3", [s], 10)
    assert not d3.allowed and d3.limit == "requests_per_minute"
    # the cancelled id is still taken (ids are unique), though it counts nowhere
    with pytest.raises(ValueError, match="request_id"):
        await lim.acquire("r1", [s], 10)


async def test_cancel_is_idempotent_and_exclusive_with_settle(backend):
    lim = backend()
    s = full()
    d1 = await lim.acquire("r1", [s], 1000)
    await lim.cancel(d1.lease)
    await lim.cancel(d1.lease)
    await lim.settle(d1.lease, 400)  # settle after cancel resurrects nothing
    await lim.cancel(d1.lease)
    assert await lim.usage(s) == ZERO

    d2 = await lim.acquire("r2", [s], 1000)
    await lim.settle(d2.lease, 400)
    settled = await lim.usage(s)
    assert settled == {"requests_in_window": 1, "tokens_in_window": 400, "concurrent": 0,
                       "day_tokens": 400, "month_tokens": 400}
    await lim.cancel(d2.lease)       # cancel after settle: the request did work
    await lim.settle(d2.lease, 900)
    assert await lim.usage(s) == settled


async def test_cancel_and_settle_racing_one_wins(backend):
    """50 requests, each settled (at 100 of its 1000 tokens) and cancelled at the same time,
    in either order: each ends either counted at 100 or not counted at all, never both nor
    half of each."""
    lim = backend()
    s = scope(requests_per_minute=100, tokens_per_minute=100_000, max_concurrent_requests=100,
              daily_token_budget=100_000)
    ds = [await lim.acquire(f"r{i}", [s], 1000) for i in range(50)]
    ops = []
    for i, d in enumerate(ds):  # settle first for even i, cancel first for odd i
        pair = [lim.settle(d.lease, 100), lim.cancel(d.lease)]
        ops += pair if i % 2 == 0 else pair[::-1]
    await asyncio.gather(*ops)
    u = await lim.usage(s)
    n = u["requests_in_window"]
    if backend.kind == "memory":  # no await inside an operation: the first one started wins
        assert n == 25
    assert u == {"requests_in_window": n, "tokens_in_window": 100 * n, "concurrent": 0,
                 "day_tokens": 100 * n, "month_tokens": 0}


@pytest.mark.parametrize("end", ["settle", "cancel"])
async def test_ended_id_stays_taken_for_its_window(mem, end):
    """r1 is admitted at T0 and ended at T0+10 (a heartbeat arrives late, at T0+20): its id is
    refused until T0+60, when its window entry leaves the window, cancelled or not."""
    lim = mem()
    s = scope(requests_per_minute=5)
    d = await lim.acquire("r1", [s], 0)
    mem.clock.advance(10)
    await (lim.settle(d.lease, 0) if end == "settle" else lim.cancel(d.lease))
    mem.clock.advance(10)
    await lim.heartbeat([d.lease])
    mem.clock.now = T0 + 59.9
    with pytest.raises(ValueError, match="request_id"):
        await lim.acquire("r1", [s], 0)
    mem.clock.now = T0 + 60
    assert (await lim.acquire("r1", [s], 0)).allowed
    # without a window (concurrency only), an ended id is free at once
    c = scope("tenant:c", max_concurrent_requests=1)
    d = await lim.acquire("r2", [c], 0)
    await (lim.settle(d.lease, 0) if end == "settle" else lim.cancel(d.lease))
    assert (await lim.acquire("r2", [c], 0)).allowed


async def test_cancel_refunds_the_day_of_the_reservation(mem):
    lim = mem()
    s = scope(daily_token_budget=1000, monthly_token_budget=10_000, tokens_per_minute=5000)
    mem.clock.now = datetime(2026, 11, 30, 23, 59, 50, tzinfo=UTC).timestamp()
    d1 = await lim.acquire("r1", [s], 800)
    mem.clock.now = datetime(2026, 12, 1, 0, 0, 10, tzinfo=UTC).timestamp()  # new day and month
    d2 = await lim.acquire("r2", [s], 500)
    assert d2.allowed
    await lim.cancel(d1.lease)
    assert await lim.usage(s) == {"requests_in_window": 1, "tokens_in_window": 500,
                                  "concurrent": 0, "day_tokens": 500, "month_tokens": 500}
    mem.clock.now = datetime(2026, 11, 30, 23, 59, 55, tzinfo=UTC).timestamp()  # look back
    u = await lim.usage(s)
    assert (u["day_tokens"], u["month_tokens"]) == (0, 0)


async def test_redis_cancel_leaves_a_tombstone_for_the_window(redis_url, redis_prefix):
    """The marker becomes a tombstone ("0") that expires with the window entry it replaces;
    neither a heartbeat nor a settlement extends or removes it."""
    import redis.asyncio as aioredis

    lim = RedisLimiter(redis_url, prefix=redis_prefix)
    client = aioredis.Redis.from_url(redis_url)
    marker = redis_prefix + "{tenant:t1}:req:r1"
    try:
        s = full()
        d = await lim.acquire("r1", [s], 100)
        assert await client.get(marker) == b"1"
        await lim.cancel(d.lease)
        await lim.heartbeat([d.lease])
        await lim.settle(d.lease, 100)
        assert await client.get(marker) == b"0"
        assert 55_000 < await client.pttl(marker) <= 60_000
        assert await lim.usage(s) == ZERO
        base = f"{redis_prefix}{{tenant:t1}}"
        assert await client.zcard(base + ":win") == 0
        assert await client.hgetall(base + ":tok") == {b"": b"0"}
    finally:
        await lim.close()
        await client.aclose()


# --------------------------------------------------------------------------------------------
# Redis specifics: keys, TTLs, unlimited scopes
# --------------------------------------------------------------------------------------------


async def test_redis_keys_expire_and_unlimited_costs_nothing(redis_url, redis_prefix):
    import redis.asyncio as aioredis

    lim = RedisLimiter(redis_url, prefix=redis_prefix)
    client = aioredis.Redis.from_url(redis_url)
    try:
        free = LimitScope("tenant:free", Quota())
        d = await lim.acquire("r0", [free], 100)
        assert d.allowed and d.lease is not None
        await lim.settle(d.lease, 50)
        assert [k async for k in client.scan_iter(match=redis_prefix + "*")] == []

        s = scope(requests_per_minute=10, tokens_per_minute=1000, max_concurrent_requests=2,
                  daily_token_budget=1000, monthly_token_budget=1000)
        d = await lim.acquire("r1", [s, free], 100)
        assert d.allowed
        keys = sorted([k.decode() async for k in client.scan_iter(match=redis_prefix + "*")])
        # win, tok, lease, day, month, marker; the pending index (3 keys), the tag's epoch and
        # the registry of tags; nothing for `free`
        assert len(keys) == 11, keys
        assert not any("tenant:free" in k for k in keys)
        index = {redis_prefix + "{tenant:t1}:" + k for k in ("pending", "pending:info", "pending:res")}
        registry = redis_prefix + "pending-tags"
        epoch = redis_prefix + "{tenant:t1}:epoch"
        assert index | {registry, epoch} <= set(keys)
        assert await client.pttl(epoch) == -1     # kept: losing it means losing the counters
        assert [t async for t, _ in client.zscan_iter(registry)] == [b"tenant:t1"]
        for k in set(keys) - index - {registry, epoch}:   # the index keys live as long as they hold an admission
            ttl = await client.pttl(k)
            assert ttl > 0, (k, ttl)
            if k.endswith(":win") or k.endswith(":tok"):
                assert 60_000 < ttl <= 61_000
            if k.endswith(":lease"):
                assert ttl <= 31_000
        await lim.settle(d.lease, 100)
        assert not await client.exists(redis_prefix + "{tenant:t1}:req:r1")
        assert not await client.exists(*index)   # settled: out of the index, which is empty
    finally:
        await lim.close()
        await client.aclose()


async def test_redis_uses_its_own_clock(redis_kind, monkeypatch):
    redis_url, redis_prefix = redis_kind
    import types

    import lockgate.tenancy.limiter.redis as limiter_mod

    real = time.time
    skewed = types.SimpleNamespace(time=lambda: real() + 3 * 86400)  # the caller is 3 days ahead
    monkeypatch.setattr(limiter_mod, "time", skewed)
    lim = RedisLimiter(redis_url, prefix=redis_prefix)
    try:
        s = scope(daily_token_budget=1000, requests_per_minute=5)
        d = await lim.acquire("r1", [s], 100)
        assert d.allowed
        assert d.lease.acquired_at == pytest.approx(real(), abs=5)
        assert d.lease.day == datetime.fromtimestamp(d.lease.acquired_at, UTC).strftime("%Y-%m-%d")
        u = await lim.usage(s)
        assert (u["day_tokens"], u["requests_in_window"]) == (100, 1)
        await lim.settle(d.lease, 40)
        assert (await lim.usage(s))["day_tokens"] == 40
    finally:
        await lim.close()


# --------------------------------------------------------------------------------------------
# exactness across OS processes (Redis)
# --------------------------------------------------------------------------------------------


def _burst_worker(url, prefix, quota, tokens, n, tag, ready_q, start, out_q, release):
    """Child process: fire ``n`` concurrent acquires at once, report, optionally hold."""
    asyncio.run(_burst(url, prefix, quota, tokens, n, tag, ready_q, start, out_q, release))


async def _burst(url, prefix, quota, tokens, n, tag, ready_q, start, out_q, release):
    lim = RedisLimiter(url, prefix=prefix)
    s = LimitScope("tenant:shared", Quota(**quota))
    await lim.usage(s)  # connect and load the script before the start signal
    ready_q.put(tag)
    start.wait(30)
    ds = await asyncio.gather(*(lim.acquire(f"{tag}-{i}", [s], tokens) for i in range(n)))
    admitted = [d for d in ds if d.allowed]
    out_q.put((tag, len(admitted), sum(d.lease.reserved_tokens for d in admitted)))
    if release is not None:
        release.wait(30)
        for d in admitted:
            await lim.settle(d.lease, tokens)
    await lim.close()


def _churn_worker(url, prefix, quota, tag, ready_q, start, out_q, holders, peak, seconds):
    asyncio.run(_churn(url, prefix, quota, tag, ready_q, start, out_q, holders, peak, seconds))


async def _churn(url, prefix, quota, tag, ready_q, start, out_q, holders, peak, seconds):
    """Child process: 50 tasks acquire, hold briefly and settle in a loop; the shared counter
    goes up after admission and down before settlement, so it never exceeds the true number
    of leases held."""
    lim = RedisLimiter(url, prefix=prefix)
    s = LimitScope("tenant:shared", Quota(**quota))
    await lim.usage(s)
    ready_q.put(tag)
    start.wait(30)
    deadline = time.monotonic() + seconds
    admissions = 0

    async def task(i: int) -> None:
        nonlocal admissions
        k = 0
        while time.monotonic() < deadline:
            d = await lim.acquire(f"{tag}-{i}-{k}", [s], 1)
            k += 1
            if d.allowed:
                admissions += 1
                with holders.get_lock():
                    holders.value += 1
                    peak.value = max(peak.value, holders.value)
                await asyncio.sleep(0.01)
                with holders.get_lock():
                    holders.value -= 1
                await lim.settle(d.lease, 1)
            else:
                await asyncio.sleep(0.002)

    await asyncio.gather(*(task(i) for i in range(50)))
    out_q.put((tag, admissions))
    await lim.close()


def _run_processes(ctx, target, args_for, ready_q, start, n=2):
    procs = [ctx.Process(target=target, args=args_for(f"p{i}"), daemon=True) for i in range(n)]
    for p in procs:
        p.start()
    for _ in procs:
        ready_q.get(timeout=60)
    start.set()
    return procs


def _join(procs):
    for p in procs:
        p.join(30)
        assert p.exitcode == 0, f"worker exited with {p.exitcode}"


@pytest.mark.parametrize("case", ["rpm", "daily_budget"])
def test_cross_process_exactness(redis_kind, case):
    redis_url, redis_prefix = redis_kind
    ctx = mp.get_context("spawn")
    ready_q, out_q, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    if case == "rpm":
        quota, tokens = {"requests_per_minute": 10}, 1
    else:
        quota, tokens = {"daily_token_budget": 1000}, 100  # fits exactly 10 requests
    procs = _run_processes(
        ctx, _burst_worker,
        lambda tag: (redis_url, redis_prefix, quota, tokens, 50, tag, ready_q, start, out_q, None),
        ready_q, start)
    results = [out_q.get(timeout=60) for _ in procs]
    _join(procs)
    assert sum(r[1] for r in results) == 10, results
    assert sum(r[2] for r in results) <= 1000


def test_cross_process_concurrency(redis_kind):
    redis_url, redis_prefix = redis_kind
    ctx = mp.get_context("spawn")
    quota = {"max_concurrent_requests": 3}
    s = LimitScope("tenant:shared", Quota(**quota))

    async def concurrent() -> int:
        lim = RedisLimiter(redis_url, prefix=redis_prefix)
        try:
            return (await lim.usage(s))["concurrent"]
        finally:
            await lim.close()

    # 1. a burst of 2 x 50 acquires, held: exactly 3 leases in total
    ready_q, out_q, start, release = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    procs = _run_processes(
        ctx, _burst_worker,
        lambda tag: (redis_url, redis_prefix, quota, 1, 50, tag, ready_q, start, out_q, release),
        ready_q, start)
    results = [out_q.get(timeout=60) for _ in procs]
    assert sum(r[1] for r in results) == 3, results
    assert asyncio.run(concurrent()) == 3
    release.set()
    _join(procs)
    assert asyncio.run(concurrent()) == 0

    # 2. churn: 2 x 50 tasks acquiring, holding and settling; never more than 3 held at once
    ready_q, out_q, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    holders, peak = ctx.Value("i", 0), ctx.Value("i", 0)
    procs = _run_processes(
        ctx, _churn_worker,
        lambda tag: (redis_url, redis_prefix, quota, tag, ready_q, start, out_q, holders, peak,
                     0.8),
        ready_q, start)
    results = [out_q.get(timeout=60) for _ in procs]
    _join(procs)
    assert sum(r[1] for r in results) > 3 * 2  # slots were reused many times
    assert 1 <= peak.value <= 3
    assert holders.value == 0
    assert asyncio.run(concurrent()) == 0


# --------------------------------------------------------------------------------------------
# bad input, factory
# --------------------------------------------------------------------------------------------


async def test_bad_input(backend):
    lim = backend()
    s = scope(requests_per_minute=10)
    with pytest.raises(ValueError, match="tokens"):
        await lim.acquire("r1", [s], -1)
    with pytest.raises(ValueError, match="tokens"):
        await lim.acquire("r1", [s], 1.5)
    with pytest.raises(ValueError, match=r"scope\.key"):
        LimitScope("tenant:bad key", Quota())
    with pytest.raises(ValueError, match=r"scope\.key"):
        LimitScope("tenant:{x}", Quota())
    with pytest.raises(ValueError, match=r"scope\.key"):
        LimitScope("", Quota())
    with pytest.raises(ValueError, match=r"scope\.quota"):
        LimitScope("tenant:t1", {"requests_per_minute": 1})
    with pytest.raises(ValueError, match="request_id"):
        await lim.acquire("", [s], 1)
    with pytest.raises(ValueError, match="scopes"):
        await lim.acquire("r1", [s, scope(requests_per_minute=5)], 1)  # same key twice
    d = await lim.acquire("r1", [s], 1)
    with pytest.raises(ValueError, match="request_id"):
        await lim.acquire("r1", [s], 1)  # still unsettled
    with pytest.raises(ValueError, match="used_tokens"):
        await lim.settle(d.lease, -5)
    with pytest.raises(ValueError, match="lease"):
        await lim.cancel("r1")
    with pytest.raises(ValueError, match="reserved_tokens"):
        await lim.cancel(dataclasses.replace(d.lease, reserved_tokens=1.5))
    assert (await lim.usage(s))["requests_in_window"] == 1  # bad calls counted nothing


async def test_make_limiter_in_process():
    lim = make_limiter(None, lease_ttl=5.0, prefix="ignored:")
    assert isinstance(lim, InProcessLimiter) and lim.lease_ttl == 5.0
    await lim.close()
    with pytest.raises(ValueError, match="lease_ttl"):
        make_limiter(None, lease_ttl=0)


async def test_make_limiter_redis(redis_url, redis_prefix):
    lim = make_limiter(redis_url, prefix=redis_prefix)
    assert isinstance(lim, RedisLimiter) and lim.lease_ttl == 30.0
    try:
        assert (await lim.acquire("r1", [scope(requests_per_minute=1)], 1)).allowed
        assert not (await lim.acquire("r2", [scope(requests_per_minute=1)], 1)).allowed
    finally:
        await lim.close()


async def test_redis_unreachable_is_limiter_unavailable():
    """No Redis at the address: acquire, settle, cancel and usage raise LimiterUnavailable
    naming it (the gateway answers 503), nothing else."""
    import socket

    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lim = RedisLimiter(f"redis://127.0.0.1:{port}/0", prefix="none:")
    sc = scope(requests_per_minute=5)
    try:
        with pytest.raises(LimiterUnavailable, match=f"127.0.0.1:{port}"):
            await lim.acquire("r1", [sc], 1)
        lease = Lease(request_id="r1", scopes=(sc,), reserved_tokens=1, day="2026-11-29",
                      month="2026-11", acquired_at=0.0)
        with pytest.raises(LimiterUnavailable):
            await lim.settle(lease, 1)
        with pytest.raises(LimiterUnavailable, match=f"127.0.0.1:{port}"):
            await lim.cancel(lease)
        with pytest.raises(LimiterUnavailable):
            await lim.usage(sc)
    finally:
        await lim.close()


# --------------------------------------------------------------------------------------------
# Redis Cluster: one slot per request, the registry of tags, URLs
# --------------------------------------------------------------------------------------------


async def test_a_requests_keys_share_one_cluster_slot(redis_cluster, cluster_prefix):
    """Every key a request's scripts touch (both scopes' win/tok/lease/day/month, its marker,
    its tag's pending index and epoch) hashes to one slot, asked of the cluster (CLUSTER KEYSLOT);
    another tenant's keys are elsewhere, and the registry of tags is apart from both."""
    lim = RedisLimiter(redis_cluster.url, prefix=cluster_prefix)
    client = redis_cluster.client()
    try:
        slots = {}
        for t in ("t1", "t2"):
            tenant = full(f"tenant:{t}")
            key = scope(f"key:{t}k", f"tenant:{t}", requests_per_minute=5, tokens_per_minute=9000,
                        max_concurrent_requests=2, daily_token_budget=9000,
                        monthly_token_budget=90_000)
            d = await lim.acquire(f"r-{t}", [tenant, key], 10)
            assert d.allowed
            await lim.heartbeat([d.lease])
            keys = {k.decode() for port in redis_cluster.ports
                    for k in _node(port).scan_iter(match=f"{cluster_prefix}{{tenant:{t}}}*")}
            # 2 scopes x (win, tok, lease, day, month) + marker + the pending index (3) + epoch
            assert len(keys) == 15, sorted(keys)
            assert f"{cluster_prefix}{{tenant:{t}}}key:{t}k:lease" in keys
            slots[t] = {client.cluster_keyslot(k) for k in keys}
            assert len(slots[t]) == 1, (t, slots[t])
        assert slots["t1"] != slots["t2"]     # two slots (so, as it happens, here two nodes)
        assert client.cluster_keyslot(f"{cluster_prefix}pending-tags") not in slots["t1"] | slots["t2"]
    finally:
        await lim.close()
        client.close()


def _node(port: int):
    import redis

    return redis.Redis(host="127.0.0.1", port=port)


async def test_scopes_of_two_tags_are_refused_on_cluster_only(redis_cluster, cluster_prefix,
                                                             redis_url, redis_prefix):
    """On Cluster one request's limited scopes must share a tag (a script cannot span slots):
    Invalid, nothing counted. One node takes them; an unlimited scope of another tag is fine
    anywhere (it touches no key)."""
    tenant, stray = scope(requests_per_minute=5), scope("key:other", requests_per_minute=5)
    free = LimitScope("key:free", Quota())
    cluster = RedisLimiter(redis_cluster.url, prefix=cluster_prefix)
    single = RedisLimiter(redis_url, prefix=redis_prefix)
    try:
        with pytest.raises(ValueError, match="share a tag"):
            await cluster.acquire("r1", [tenant, stray], 1)
        assert (await cluster.usage(tenant))["requests_in_window"] == 0
        assert (await cluster.acquire("r2", [tenant, free], 1)).allowed
        d = await single.acquire("r1", [tenant, stray], 1)
        assert d.allowed
        assert (await single.usage(stray))["requests_in_window"] == 1
        await single.settle(d.lease, 1)
    finally:
        await cluster.close()
        await single.close()


async def test_expired_walks_every_tag_and_prunes_idle_ones(redis_kind, monkeypatch):
    """Three tenants' admissions die; `expired` finds all three through the registry of tags
    (on Cluster, in different slots), oldest first, at most `limit`. A tag whose index is empty
    leaves the registry only once nobody registered it for PRUNE_AFTER."""
    import lockgate.tenancy.limiter.redis as limiter_mod

    redis_url, redis_prefix = redis_kind
    lim = RedisLimiter(redis_url, prefix=redis_prefix, lease_ttl=0.2)
    try:
        for t in ("a", "b", "c"):
            assert (await lim.acquire(f"r-{t}", [scope(f"tenant:{t}", daily_token_budget=100)], 7)).allowed
        await asyncio.sleep(0.3)
        found = await lim.expired()
        assert [x.request_id for x in found] == ["r-a", "r-b", "r-c"]
        assert [x.request_id for x in await lim.expired(limit=2)] == ["r-a", "r-b"]
        for lease in found:
            assert await lim.abandon(lease)
        assert await lim.expired() == []
        tags = await lim._call([f"{redis_prefix}pending-tags"], ["tags"])
        assert sorted(tags) == [b"tenant:a", b"tenant:b", b"tenant:c"]    # registered just now
        monkeypatch.setattr(limiter_mod, "PRUNE_AFTER", 0.0)
        assert await lim.expired() == []
        assert await lim._call([f"{redis_prefix}pending-tags"], ["tags"]) == []
        # the limiter's own note says "registered": it still is, until REGISTER_EVERY has
        # passed; so a pruned tag's new admissions are only found once it registers again
        monkeypatch.setattr(limiter_mod, "REGISTER_EVERY", 0.0)
        assert (await lim.acquire("r-d", [scope("tenant:a", daily_token_budget=100)], 7)).allowed
        await asyncio.sleep(0.3)
        assert [x.request_id for x in await lim.expired()] == ["r-d"]
    finally:
        await lim.close()


def test_cluster_and_sentinel_urls_parse():
    from lockgate.tenancy.limiter.redis_conn import ClientConnection, connect, parse_multi_host
    from lockgate.tenancy.limiter.redis_pipe import RedisPipe

    u = parse_multi_host("rediss+cluster://me:s%40cret@10.0.0.1:7000,[::1]:7001,node3")
    assert u.tls and u.hosts == (("10.0.0.1", 7000), ("::1", 7001), ("node3", 6379))
    assert (u.username, u.password) == ("me", "s@cret")
    u = parse_multi_host("redis+sentinel://:pw@s1:26379,s2:26380/mymaster/2?sentinel_password=x")
    assert not u.tls and u.path == ("mymaster", "2") and u.query == {"sentinel_password": "x"}
    assert (u.username, u.password) == (None, "pw")
    assert isinstance(connect("redis://127.0.0.1:6379/0", timeout=0.25), RedisPipe)
    conn = connect("redis+cluster://127.0.0.1:7000", timeout=0.25)
    assert isinstance(conn, ClientConnection) and conn.one_slot
    conn = connect("redis+sentinel://127.0.0.1:26379/mymaster", timeout=0.25)
    assert isinstance(conn, ClientConnection) and not conn.one_slot and "mymaster" in conn.where
    for bad in ("redis+sentinel://127.0.0.1:26379", "redis+sentinel://h:1/m/x",
                "redis+cluster://h:port"):
        with pytest.raises(ValueError, match="redis_url"):
            connect(bad, timeout=0.25)
    with pytest.raises(ValueError, match="prefix"):
        RedisLimiter("redis://127.0.0.1:6379/0", prefix="{x}")


async def test_unreachable_cluster_and_sentinel_are_limiter_unavailable():
    """Nothing listens at the cluster's or the sentinel's address: LimiterUnavailable naming it,
    within the bound of a call (CLIENT_CALL_WAITS x timeout; asserted with a wide margin, since
    the bound is the behaviour)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for url in (f"redis+cluster://127.0.0.1:{port}", f"redis+sentinel://127.0.0.1:{port}/m"):
        lim = RedisLimiter(url, prefix="none:", timeout=0.2)
        try:
            t0 = time.monotonic()
            with pytest.raises(LimiterUnavailable, match=f"127.0.0.1:{port}"):
                await lim.acquire("r1", [scope(requests_per_minute=5)], 1)
            assert time.monotonic() - t0 < 3.0
            assert await lim.check() == "unavailable"
        finally:
            await lim.close()


async def test_limiter_through_sentinel(tmp_path):
    """A ``redis+sentinel://`` URL: the limiter asks a sentinel (a ``redis-server
    --sentinel`` of the test's own) for the master of ``mymaster`` and counts there."""
    import shutil
    import subprocess

    from tests.support.gateway_server import free_port
    from tests.support.own_redis import OwnRedis

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    master = OwnRedis(tmp_path)
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                    f"sentinel monitor mymaster 127.0.0.1 {master.port} 1\n")
    sentinel = subprocess.Popen(["redis-server", str(conf), "--sentinel"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lim = RedisLimiter(f"redis+sentinel://127.0.0.1:{port}/mymaster", prefix="sentinel:",
                       timeout=1.0)
    try:
        s = scope(requests_per_minute=2, daily_token_budget=1000)
        deadline = time.monotonic() + 10
        while await lim.check() != "ok":          # the sentinel starts
            assert time.monotonic() < deadline, "sentinel not up"
            await asyncio.sleep(0.05)
        d = await lim.acquire("r1", [s], 100)
        assert d.allowed and (await lim.acquire("r2", [s], 100)).allowed
        assert not (await lim.acquire("r3", [s], 100)).allowed
        await lim.settle(d.lease, 40)
        assert (await lim.usage(s))["day_tokens"] == 140
        import redis

        direct = redis.Redis(port=master.port)
        assert direct.get("sentinel:{tenant:t1}:day:" + d.lease.day) == b"140"  # on the master
        direct.close()
    finally:
        await lim.close()
        sentinel.terminate()
        sentinel.wait(10)
        master.stop()
