"""Refusal counts (`tenancy.usage.refusals`): 429s counted in memory, added to the table by
flushes that replicas share; a flush the database does not take keeps its counts for the
next, within a bound on memory and time. And the limiter's read of a scope's live counters
(`Limiter.live_usage`), which the quota report shows beside each limit, on both backends."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from datetime import UTC, datetime

import pytest

from lockgate.tenancy import db as tdb
from lockgate.tenancy.limiter.base import WINDOW
from lockgate.tenancy.usage.refusals import RefusalCounter, refusal_totals
from tests.support import services
from tests.tenancy.test_limiter import Backend, redis_of, scope

T0 = 1_700_000_040.0          # a minute's start (epoch s)


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def totals(sessions, tenant_ids=None, start=None, end=None):
    async with sessions() as s:
        return await refusal_totals(s, tenant_ids=tenant_ids, start=start, end=end)


async def test_flushes_of_two_replicas_add_up_by_minute(sessions):
    """Two counters (two replicas) count the same tenant, key and limit in the same minute:
    each flush adds its deltas to the one row; a later minute is a row of its own, which a
    range can leave out. The totals add up every tier."""
    clock = Clock()
    one, two = (RefusalCounter(sessions, clock=clock) for _ in range(2))
    for _ in range(3):
        one.record("ten_a", "key_a", "tenant", "requests_per_minute", tier="default")
    two.record("ten_a", "key_a", "tenant", "requests_per_minute", tier="flex")    # a row of its own
    two.record("ten_a", "key_a", "key", "daily_token_budget", tier="default")
    one.record("ten_b", "key_b", "tenant", "requests_per_minute", tier="default")
    assert (one.pending, two.pending) == (4, 2)
    assert await totals(sessions) == {}                      # nothing written before a flush
    assert await one.flush() and await two.flush()
    assert (one.pending, one.flushed, two.flushed) == (0, 4, 2)
    clock.now += 60
    one.record("ten_a", "key_a", "tenant", "requests_per_minute", tier="default")
    assert await one.flush()
    assert await one.flush()                                 # nothing left: a no-op
    assert await totals(sessions) == {
        ("ten_a", "key_a"): {("tenant", "requests_per_minute"): 5, ("key", "daily_token_budget"): 1},
        ("ten_b", "key_b"): {("tenant", "requests_per_minute"): 1}}
    first_minute = (datetime.fromtimestamp(T0, UTC), datetime.fromtimestamp(T0 + 60, UTC))
    assert await totals(sessions, ["ten_a"], *first_minute) == {
        ("ten_a", "key_a"): {("tenant", "requests_per_minute"): 4, ("key", "daily_token_budget"): 1}}


async def test_the_bound_on_counters_drops_and_counts(sessions, caplog):
    counter = RefusalCounter(sessions, max_buckets=2)
    counter.record("ten_a", "key_a", "tenant", "requests_per_minute", tier="default")
    counter.record("ten_a", "key_b", "tenant", "requests_per_minute", tier="default")
    counter.record("ten_a", "key_b", "tenant", "requests_per_minute", tier="default")   # a held counter: kept
    counter.record("ten_a", "key_c", "tenant", "requests_per_minute", tier="default")   # a third: dropped
    assert (counter.pending, counter.dropped) == (3, 1)
    assert await counter.flush()
    assert "1 refusals dropped" in caplog.text


class HungSessions:
    """A database that takes the connection and never answers."""

    def __call__(self):
        return self

    async def __aenter__(self):
        await asyncio.sleep(3600)

    async def __aexit__(self, *exc):
        return False


async def test_a_flush_is_bounded_in_time_and_keeps_its_counts():
    counter = RefusalCounter(HungSessions(), timeout_s=0.2)
    counter.record("ten_a", "key_a", "tenant", "tokens_per_minute", tier="default")
    t0 = time.monotonic()
    assert not await counter.flush()
    assert time.monotonic() - t0 < 1.0
    assert (counter.pending, counter.failed_flushes) == (1, 1)
    counter.record("ten_a", "key_a", "tenant", "tokens_per_minute", tier="default")
    assert counter.pending == 2


async def test_counts_of_a_failed_flush_are_written_once_the_database_is_back():
    """The database does not exist yet (every connection refused): flushes fail and keep
    the counts, with those counted meanwhile; once it is there, one flush writes them all,
    and `close` (stop, then a last flush) writes what came after."""
    name = f"lg_{secrets.token_hex(4)}_later"
    url = f"postgresql+asyncpg://{services.PG_USER}@{services.PG_HOST}:{services.PG_PORT}/{name}"
    engine = tdb.make_engine(url)
    counter = RefusalCounter(tdb.make_sessionmaker(engine), interval_s=0.05, timeout_s=2.0)
    try:
        for _ in range(3):
            counter.record("ten_a", "key_a", "tenant", "requests_per_minute", tier="default")
        assert not await counter.flush()
        counter.record("ten_a", "key_a", "tenant", "requests_per_minute", tier="default")
        counter.start()                   # background flushes keep failing meanwhile
        await asyncio.sleep(0.2)
        assert counter.pending == 4 and counter.failed_flushes >= 2
        with services._pg_admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        await tdb.upgrade_async(url)
        deadline = time.monotonic() + 5
        while counter.flushed < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert counter.pending == 0 and counter.flushed == 4
        counter.record("ten_a", "key_a", "key", "max_concurrent_requests", tier="default")
        await counter.close()
        assert await totals(tdb.make_sessionmaker(engine)) == {
            ("ten_a", "key_a"): {("tenant", "requests_per_minute"): 4,
                                 ("key", "max_concurrent_requests"): 1}}
    finally:
        await counter.close()
        await engine.dispose()
        with contextlib.suppress(Exception), services._pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


# -- the limiter's read of a scope's live counters ----------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def backend(request):
    b = Backend(request.param, *redis_of(request, request.param))
    yield b
    for lim in b.made:
        await lim.close()


async def test_usage_reads_windows_leases_budgets_and_when_they_fall(backend):
    """Two requests 10 s apart: the window holds both, the tokens' oldest entry is the
    second's (the first settled to 0 tokens), the leases one, the budgets their tokens.
    An unlimited scope's counters read 0 and never fall."""
    lim = backend()
    s = scope(requests_per_minute=5, tokens_per_minute=1000, max_concurrent_requests=3,
              daily_token_budget=10_000, monthly_token_budget=100_000)
    empty = await lim.live_usage(s)
    assert empty == {"requests_in_window": 0, "tokens_in_window": 0, "concurrent": 0,
                     "day_tokens": 0, "month_tokens": 0, "requests_reset_at": None,
                     "tokens_reset_at": None}
    first = await lim.acquire("r1", [s], 0)
    assert first.lease is not None
    await lim.settle(first.lease, 0)
    t_first = time.time() if backend.kind == "redis" else backend.clock.now
    await backend.sleep(0.3 if backend.kind == "redis" else 10)
    second = await lim.acquire("r2", [s], 120)
    assert second.allowed
    t_second = time.time() if backend.kind == "redis" else backend.clock.now
    u = await lim.live_usage(s)
    assert (u["requests_in_window"], u["tokens_in_window"], u["concurrent"]) == (2, 120, 1)
    assert (u["day_tokens"], u["month_tokens"]) == (120, 120)
    slack = 0.2 if backend.kind == "redis" else 0.0         # Redis's clock against ours
    assert u["requests_reset_at"] == pytest.approx(t_first + WINDOW, abs=slack)
    assert u["tokens_reset_at"] == pytest.approx(t_second + WINDOW, abs=slack)
    assert u["tokens_reset_at"] > u["requests_reset_at"]
    assert await lim.live_usage(scope("key:k9", tag="tenant:t1")) == empty
