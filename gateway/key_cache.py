"""`KeyCache`: the principals of presented API keys, by a digest of the key, refreshed in the
background while fresh enough, so a revocation reaches every replica within seconds."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from lockgate.tenancy.auth import Principal

Lookup = Callable[[str], Awaitable[Principal]]
Spawn = Callable[[Coroutine[Any, Any, None]], Any]


class KeyCache:
    """Principals by a digest of the presented key. An entry younger than `ttl` is used as
    is; one between `ttl` and `2 x ttl` old is used while one background lookup refreshes
    it; older ones are looked up before use. Concurrent lookups of one key share a single
    database query. So a revoked key stops working on every replica within `2 x ttl` plus
    one lookup, and a busy key never makes its requests wait for the database. The
    plaintext is not kept."""

    MAX_ENTRIES = 100_000      # past this many keys the cache starts again from empty

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._entries: dict[bytes, tuple[float, Principal]] = {}
        self._inflight: dict[bytes, asyncio.Future[Principal]] = {}

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def get(self, key: str) -> Principal | None:
        hit = self._entries.get(self._digest(key))
        if hit is None or time.monotonic() - hit[0] > self.ttl:
            return None
        return hit[1]

    def put(self, key: str, principal: Principal) -> None:
        if len(self._entries) > self.MAX_ENTRIES:
            self._entries.clear()
        self._entries[self._digest(key)] = (time.monotonic(), principal)

    async def resolve(self, key: str, lookup: Lookup, spawn: Spawn) -> Principal:
        """The principal for `key`, fresh enough (see the class docstring). `lookup(key)`
        queries the database; `spawn(coro)` runs a background refresh."""
        d = self._digest(key)
        hit = self._entries.get(d)
        age = time.monotonic() - hit[0] if hit else None
        if hit is not None and age is not None and age <= self.ttl:
            return hit[1]
        fut = self._inflight.get(d)
        if hit is not None and age is not None and age <= 2 * self.ttl:
            if fut is None:
                spawn(self._refresh(d, key, lookup, self._start(d)))
            return hit[1]
        if fut is None:
            fut = self._start(d)
            await self._refresh(d, key, lookup, fut)
        return await asyncio.shield(fut)

    def _start(self, d: bytes) -> asyncio.Future[Principal]:
        """Mark a lookup of `d` as under way (before it starts, so no second one begins)."""
        fut: asyncio.Future[Principal] = asyncio.get_running_loop().create_future()
        self._inflight[d] = fut
        return fut

    async def _refresh(self, d: bytes, key: str, lookup: Lookup, fut: asyncio.Future[Principal]) -> None:
        """Look `key` up; the result or the error goes to `fut` (never raised here)."""
        try:
            principal = await lookup(key)
        except BaseException as exc:  # whatever it is: handed to whoever waits on fut
            self._entries.pop(d, None)
            if not fut.done():
                fut.set_exception(exc)
                fut.exception()         # retrieved: no warning when nobody waits
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            self.put(key, principal)
            if not fut.done():
                fut.set_result(principal)
        finally:
            if self._inflight.get(d) is fut:
                del self._inflight[d]

    def invalidate_key_id(self, key_id: str) -> None:
        for d, (_, p) in list(self._entries.items()):
            if p.key_id == key_id:
                self._entries.pop(d, None)

    def invalidate_tenant(self, tenant_id: str) -> None:
        for d, (_, p) in list(self._entries.items()):
            if p.tenant_id == tenant_id:
                self._entries.pop(d, None)
