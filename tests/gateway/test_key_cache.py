"""The gateway's key cache: fresh hits, stale-while-refresh, one lookup for many misses."""

from __future__ import annotations

import asyncio
import time

import pytest

from lockgate.gateway.key_cache import KeyCache
from lockgate.tenancy import keys
from lockgate.tenancy.errors import AuthError, UnknownKeyPrefix


class Lookups:
    def __init__(self, delay=0.05):
        self.calls = 0
        self.delay = delay
        self.revoked = False

    async def __call__(self, key):
        self.calls += 1
        await asyncio.sleep(self.delay)
        if self.revoked:
            raise AuthError("revoked")
        return f"principal-of-{key}"


async def test_concurrent_misses_share_one_lookup():
    cache, lookup = KeyCache(ttl=1.0), Lookups()
    tasks = []
    results = await asyncio.gather(*(cache.resolve("k", lookup, tasks.append) for _ in range(20)))
    assert results == ["principal-of-k"] * 20 and lookup.calls == 1
    assert await cache.resolve("k", lookup, tasks.append) == "principal-of-k" and lookup.calls == 1


async def test_stale_entry_served_while_one_refresh_runs_then_revocation_lands():
    """Between ttl and 2 x ttl the old principal is served at once and one background lookup
    refreshes it; when that lookup finds the key revoked, the next use is refused."""
    cache, lookup = KeyCache(ttl=0.2), Lookups(delay=0.05)
    spawned = []

    def spawn(coro):
        spawned.append(asyncio.get_running_loop().create_task(coro))

    await cache.resolve("k", lookup, spawn)
    await asyncio.sleep(0.25)                      # stale, not expired
    lookup.revoked = True
    t0 = time.monotonic()
    assert await cache.resolve("k", lookup, spawn) == "principal-of-k"
    assert await cache.resolve("k", lookup, spawn) == "principal-of-k"
    assert time.monotonic() - t0 < 0.04            # no waiting on the database
    assert len(spawned) == 1                       # one refresh, not one per request
    await asyncio.gather(*spawned)
    with pytest.raises(AuthError):
        await cache.resolve("k", lookup, spawn)


async def test_expired_entry_is_looked_up_before_use():
    cache, lookup = KeyCache(ttl=0.05), Lookups(delay=0.01)
    await cache.resolve("k", lookup, lambda c: None)
    await asyncio.sleep(0.12)                      # older than 2 x ttl
    lookup.revoked = True
    with pytest.raises(AuthError):
        await cache.resolve("k", lookup, lambda c: None)
    assert lookup.calls == 2


async def test_adapter_misses_are_cached_briefly_and_bounded(tmp_path, monkeypatch):
    """Model names that resolve to no adapter: one database read per name per second, and
    made-up names by the thousand cannot grow the cache without bound."""
    from lockgate.gateway.adapter_catalog import AdapterCatalog
    from lockgate.tenancy import adapters, db
    from lockgate.tenancy.models import Base

    engine = db.make_engine(f"sqlite+aiosqlite:///{tmp_path / 'a.db'}")
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    reads = []
    real_find = adapters.find_adapter

    async def counting_find(session, name):
        reads.append(name)
        return await real_find(session, name)

    monkeypatch.setattr(adapters, "find_adapter", counting_find)
    monkeypatch.setattr(AdapterCatalog, "MAX_MISSES", 50)
    catalog = AdapterCatalog(db.make_sessionmaker(engine), tmp_path, {}, ttl=30.0)
    try:
        assert await catalog.lookup("nope") is None
        assert await catalog.lookup("nope") is None
        assert reads == ["nope"]                      # the second answered from the cache
        for i in range(500):
            assert await catalog.lookup(f"made-up-{i}") is None
        assert len(catalog._missing) <= 50            # bounded, not 501
        assert len(reads) == 501
    finally:
        await engine.dispose()


async def test_remembered_refusals_are_bounded_oldest_first():
    cache = KeyCache(ttl=60.0)
    cache.MAX_REFUSALS = 3

    async def unknown(key):
        raise UnknownKeyPrefix()

    presented = ["lg-" + f"{i:012d}" + "s" * 20 for i in range(5)]
    for key in presented:
        with pytest.raises(AuthError):
            await cache.resolve(key, unknown, lambda c: None)
    assert list(cache._missing) == [keys.lookup_prefix(k) for k in presented[2:]]
    cache.forget_missing(keys.lookup_prefix(presented[4]))
    assert keys.lookup_prefix(presented[4]) not in cache._missing
