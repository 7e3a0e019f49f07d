"""A Redis that accepts connections and never answers (stopped, swapping, stuck in a slow
script), at the limiter's level: a `redis-server` this file starts on its own port and stops
with SIGSTOP, or a socket that accepts and never answers.

Every call to it ends within the timeout (250 ms by default) with a Redis error, every
waiter on the dropped connection fails with it, and the call after SIGCONT succeeds on a
new connection. `FailoverLimiter` on top: closed refuses (`LimiterUnavailable`), open admits
through the in-process limiter (one outage, logged once, counted), settlements that cannot
reach Redis are queued (bounded, drops logged) and applied once it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

import pytest
from redis.exceptions import RedisError

from lockgate.tenancy.errors import LimiterUnavailable
from lockgate.tenancy.limiter import FailoverLimiter, InProcessLimiter, LimitScope, RedisLimiter
from lockgate.tenancy.limiter.redis_pipe import RedisPipe
from lockgate.tenancy.quota import Quota
from tests.support.own_redis import OwnRedis

TIMEOUT = 0.25          # RedisPipe's and RedisLimiter's default
BOUND = 1.0             # a failed call must end within this (the timeout plus slack)


@pytest.fixture
def own_redis(tmp_path):
    srv = OwnRedis(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def silent_listener():
    """A port whose socket accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


async def fails_in_time(call, error=RedisError) -> float:
    """Await `call`, which must raise `error` within BOUND seconds; the seconds it took.
    The outer 3 s bound only keeps a hung call from hanging the test."""
    t0 = time.monotonic()
    with pytest.raises(error):
        await asyncio.wait_for(call, 3)
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND, f"took {elapsed:.2f}s"
    return elapsed


SCOPE = LimitScope("tenant:t1", Quota(requests_per_minute=100, max_concurrent_requests=5))


async def eventually(predicate, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not await predicate():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.02)


# -- the pipe ------------------------------------------------------------------------------------
async def test_a_hung_redis_fails_within_the_timeout_and_the_call_after_sigcont_succeeds(own_redis):
    pipe = RedisPipe(own_redis.url)
    assert await pipe.execute("PING") == b"PONG"
    own_redis.pause()
    calls = [asyncio.ensure_future(pipe.execute("ECHO", f"v{i}")) for i in range(20)]
    await fails_in_time(pipe.execute("PING"))
    # every waiter on the dropped connection failed with it, none is left hanging
    done = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), BOUND)
    assert all(isinstance(r, RedisError) for r in done), done
    own_redis.resume()
    assert await asyncio.wait_for(pipe.execute("PING"), 3) == b"PONG"
    await pipe.aclose()


async def test_a_busy_event_loop_is_not_a_dead_redis(redis_url):
    """The loop held past the timeout (a flood's work) while Redis answered at once: the
    reply is read, not declared missing. A hung Redis is still found within the bound (the
    tests around this one)."""
    pipe = RedisPipe(redis_url)
    assert await pipe.execute("PING") == b"PONG"
    calls = [asyncio.ensure_future(pipe.execute("ECHO", f"v{i}")) for i in range(5)]
    await asyncio.sleep(0)                      # every command written
    time.sleep(3 * TIMEOUT)                     # the loop held on purpose
    assert await asyncio.gather(*calls) == [f"v{i}".encode() for i in range(5)]
    # and a command written while the loop is already behind: timed from its write
    call = asyncio.ensure_future(pipe.execute("PING"))
    await asyncio.sleep(0)
    time.sleep(3 * TIMEOUT)
    assert await call == b"PONG"
    await pipe.aclose()


async def test_select_at_connect_is_bounded_by_the_timeout(own_redis):
    pipe = RedisPipe(own_redis.url.replace("/0", "/2"))
    own_redis.pause()       # the kernel still accepts the connection; SELECT is never answered
    await fails_in_time(pipe.execute("PING"))
    own_redis.resume()
    assert await asyncio.wait_for(pipe.execute("PING"), 3) == b"PONG"
    await pipe.aclose()


async def test_a_socket_that_never_answers_is_limiter_unavailable_within_the_timeout():
    with silent_listener() as port:
        lim = RedisLimiter(f"redis://127.0.0.1:{port}/0", prefix="lgtest:hang:")
        await fails_in_time(lim.acquire("r1", [SCOPE], 10), LimiterUnavailable)
        await lim.close()


async def test_a_heartbeat_on_a_hung_redis_ends_within_the_timeout(own_redis):
    lim = RedisLimiter(own_redis.url, prefix=f"lgtest:{os.getpid()}:{time.monotonic_ns()}:")
    d = await lim.acquire("a", [SCOPE], 1)
    assert d.lease is not None
    own_redis.pause()
    await fails_in_time(lim.heartbeat([d.lease]), LimiterUnavailable)
    own_redis.resume()
    await asyncio.wait_for(lim.heartbeat([d.lease]), 3)
    await lim.close()


# -- FailoverLimiter -----------------------------------------------------------------------------
def failover(url: str, mode: str, **kw) -> FailoverLimiter:
    prefix = f"lgtest:{os.getpid()}:{time.monotonic_ns()}:"
    fallback = InProcessLimiter() if mode == "open" else None
    return FailoverLimiter(RedisLimiter(url, prefix=prefix, timeout=TIMEOUT), fallback=fallback,
                           **kw)


async def test_closed_refuses_within_the_timeout_then_at_once_and_recovers(own_redis):
    lim = failover(own_redis.url, "closed")
    assert (await lim.acquire("a", [SCOPE], 1)).allowed
    assert await lim.check() == "ok"
    own_redis.pause()
    await fails_in_time(lim.acquire("b", [SCOPE], 1), LimiterUnavailable)
    # the outage is known: refused at once, and /ready's check answers without waiting
    assert await fails_in_time(lim.acquire("c", [SCOPE], 1), LimiterUnavailable) < 0.05
    t0 = time.monotonic()
    assert await lim.check() == "unavailable"
    assert time.monotonic() - t0 < 0.05
    own_redis.resume()

    async def back() -> bool:
        return await lim.check() == "ok"

    await eventually(back)
    assert (await lim.acquire("d", [SCOPE], 1)).allowed
    assert lim.counts["outages"] == 1
    await lim.close()


async def test_open_admits_in_process_per_replica_logs_once_and_goes_back_to_redis(own_redis, caplog):
    lim = failover(own_redis.url, "open")
    fresh = LimitScope("tenant:t2", Quota(requests_per_minute=2))
    own_redis.pause()
    with caplog.at_level(logging.WARNING, logger="lockgate.tenancy.limiter.failover"):
        t0 = time.monotonic()
        first = await lim.acquire("a", [fresh], 1)
        assert first.allowed and time.monotonic() - t0 < BOUND
        assert (await lim.acquire("b", [fresh], 1)).allowed
        refused = await lim.acquire("c", [fresh], 1)     # the in-process limiter enforces it
        assert not refused.allowed and refused.limit == "requests_per_minute"
        assert await lim.check() == "degraded"
        await lim.settle(first.lease, 1)                   # settled where it was admitted
    outage_lines = [r for r in caplog.records if "does not answer" in r.getMessage()]
    assert len(outage_lines) == 1, caplog.text
    assert lim.counts["outages"] == 1 and lim.counts["fallback_decisions"] == 3
    own_redis.resume()

    async def back() -> bool:
        return await lim.check() == "ok"

    await eventually(back)
    assert (await lim.acquire("d", [fresh], 1)).allowed             # Redis's window: empty
    assert (await lim.primary.usage(fresh))["requests_in_window"] == 1
    await lim.close()


async def test_a_settlement_on_a_hung_redis_is_queued_and_applied_once_it_answers(own_redis):
    lim = failover(own_redis.url, "closed")
    d = await lim.acquire("a", [SCOPE], 100)
    assert d.lease is not None
    own_redis.pause()
    t0 = time.monotonic()
    await asyncio.wait_for(lim.settle(d.lease, 7), 3)     # never raises, never hangs
    assert time.monotonic() - t0 < BOUND
    assert lim.queued == 1
    t0 = time.monotonic()
    await lim.heartbeat([d.lease])       # the outage is known: Redis is not waited on
    assert time.monotonic() - t0 < 0.05
    own_redis.resume()

    async def drained() -> bool:
        return lim.queued == 0

    await eventually(drained)
    usage = await lim.primary.usage(SCOPE)
    assert usage["concurrent"] == 0 and usage["tokens_in_window"] == 7
    await lim.close()


async def test_the_settlement_queue_is_bounded_and_logs_each_drop(own_redis, caplog):
    lim = failover(own_redis.url, "closed", max_queued=2)
    leases = [(await lim.acquire(f"r{i}", [SCOPE], 10)).lease for i in range(3)]
    own_redis.pause()
    with caplog.at_level(logging.WARNING, logger="lockgate.tenancy.limiter.failover"):
        for lease in leases:
            assert lease is not None
            await asyncio.wait_for(lim.settle(lease, 1), 3)
    assert lim.queued == 2 and lim.counts["settlements_dropped"] == 1
    assert any("dropped" in r.getMessage() and "r0" in r.getMessage() for r in caplog.records)
    own_redis.resume()
    await lim.close()
