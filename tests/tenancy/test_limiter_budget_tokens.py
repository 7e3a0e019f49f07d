"""Settling with `budget_tokens`: the budgets count what the plan prices (cached prompt tokens
below others), the tokens-per-minute window every token; on every backend, and as the failover
wrapper replays a settlement it queued while Redis was away."""

from __future__ import annotations

import pytest

from lockgate.tenancy.limiter import InProcessLimiter
from lockgate.tenancy.limiter.failover import _Pending
from lockgate.tenancy.quota import budget_tokens
from tests.tenancy.test_limiter import Backend, redis_of, scope


@pytest.fixture(params=["memory", "redis", "cluster"])
async def backend(request):
    b = Backend(request.param, *redis_of(request, request.param))
    yield b
    for lim in b.made:
        await lim.close()


async def test_budgets_count_the_priced_tokens_and_the_window_all_of_them(backend):
    lim = backend()
    s = scope(tokens_per_minute=10_000, daily_token_budget=5000, monthly_token_budget=9000)
    d = await lim.acquire("r1", [s], 400)
    assert d.allowed and d.lease is not None
    await lim.settle(d.lease, 250, budget_tokens=150)
    u = await lim.usage(s)
    assert (u["tokens_in_window"], u["day_tokens"], u["month_tokens"], u["concurrent"]) == (250, 150, 150, 0)
    await lim.settle(d.lease, 250, budget_tokens=10)        # settled already: a no-op
    u = await lim.usage(s)
    assert (u["tokens_in_window"], u["day_tokens"]) == (250, 150)
    d2 = await lim.acquire("r2", [s], 100)
    await lim.settle(d2.lease, 80)                           # no price: the budgets count all
    u = await lim.usage(s)
    assert (u["tokens_in_window"], u["day_tokens"], u["month_tokens"]) == (330, 230, 230)


def test_budget_tokens_rounds_the_cached_part_up_once_per_request():
    assert budget_tokens(100, 40, 10, 1.0) == 110
    assert budget_tokens(100, 40, 10, 0.5) == 60 + 20 + 10
    assert budget_tokens(100, 41, 10, 0.5) == 59 + 21 + 10     # 20.5 -> 21
    assert budget_tokens(100, 30, 0, 0.1) == 70 + 3            # 0.1 as written: 3, not 4
    assert budget_tokens(100, 40, 10, 0.0) == 70
    assert budget_tokens(10, 99, 1, 0.5) == 5 + 1               # never more cached than prompt


async def test_a_queued_settlement_keeps_its_budget_tokens():
    lim = InProcessLimiter()
    s = scope(tokens_per_minute=10_000, daily_token_budget=5000)
    d = await lim.acquire("r1", [s], 400)
    await _Pending("settle", d.lease, 250, 150).run(lim)      # as FailoverLimiter drains its queue
    u = await lim.usage(s)
    assert (u["tokens_in_window"], u["day_tokens"]) == (250, 150)
