"""`KeyCache`: the principals of presented API keys, by a digest of the key, refreshed in the
background while fresh enough, so a revocation reaches every replica within seconds; and the
refusals, remembered as briefly, so a flood of one bad key is not a database lookup each."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from lockgate.tenancy import keys
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import AuthError, UnknownKeyPrefix

Lookup = Callable[[str], Awaitable[Principal]]
Spawn = Callable[[Coroutine[Any, Any, None]], Any]


class KeyCache:
    """Principals by a digest of the presented key. An entry younger than `ttl` is used as
    is; one between `ttl` and `2 x ttl` old is used while one background lookup refreshes
    it; older ones are looked up before use. Concurrent lookups of one key share a single
    database query. So a revoked key stops working on every replica within `2 x ttl` plus
    one lookup, and a busy key never makes its requests wait for the database. The
    plaintext is not kept.

    A refusal is remembered for `ttl` too: a lookup prefix no key has (any key with it is
    unknown: one lookup answers for every secret behind it), else the refused key's digest
    with its reason. So a key created after a miss works within `ttl` on every replica, and
    at once on the replica that made it (`forget_missing`). At most `MAX_REFUSALS` are kept,
    the oldest forgotten first: a flood of distinct keys costs memory no more than that."""

    MAX_ENTRIES = 100_000      # past this many keys the cache starts again from empty
    MAX_REFUSALS = 10_000

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._entries: dict[bytes, tuple[float, Principal]] = {}
        self._inflight: dict[bytes, asyncio.Future[Principal]] = {}
        # insertion-ordered, so the first is the oldest: lookup prefix -> when it missed,
        # key digest -> (when, reason)
        self._missing: dict[str, float] = {}
        self._refused: dict[bytes, tuple[float, str]] = {}
        # bumped whenever remembered refusals are forgotten: a lookup that began before
        # then may have read the database before the change, so its refusal is not kept
        self._epoch = 0

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
        if hit is None:
            self._check_refused(key, d)
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
        epoch = self._epoch
        try:
            principal = await lookup(key)
        except BaseException as exc:  # whatever it is: handed to whoever waits on fut
            self._entries.pop(d, None)
            if isinstance(exc, AuthError) and epoch == self._epoch:
                self._remember(key, d, exc)
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

    def _check_refused(self, key: str, d: bytes) -> None:
        """Raise the refusal remembered for `key` within `ttl`, if any (expired ones go)."""
        now = time.monotonic()
        if keys.well_formed(key):
            prefix = keys.lookup_prefix(key)
            seen = self._missing.get(prefix)
            if seen is not None:
                if now - seen <= self.ttl:
                    raise UnknownKeyPrefix()
                del self._missing[prefix]
        refused = self._refused.get(d)
        if refused is not None:
            if now - refused[0] <= self.ttl:
                raise AuthError(refused[1])
            del self._refused[d]

    def _remember(self, key: str, d: bytes, exc: AuthError) -> None:
        """Keep the refusal of a key the database was asked about (a malformed key never is)."""
        if not keys.well_formed(key):
            return
        now = time.monotonic()
        if isinstance(exc, UnknownKeyPrefix):
            prefix = keys.lookup_prefix(key)
            self._missing.pop(prefix, None)         # re-inserted last: the newest
            self._missing[prefix] = now
        else:
            self._refused.pop(d, None)
            self._refused[d] = (now, exc.reason)
        while len(self._missing) + len(self._refused) > self.MAX_REFUSALS:
            if self._older(self._missing, self._refused):
                del self._missing[next(iter(self._missing))]
            else:
                del self._refused[next(iter(self._refused))]

    @staticmethod
    def _older(missing: dict[str, float], refused: dict[bytes, tuple[float, str]]) -> bool:
        """Whether `missing` holds the oldest remembered refusal of the two."""
        if not refused:
            return True
        if not missing:
            return False
        return missing[next(iter(missing))] <= refused[next(iter(refused))][0]

    def forget_missing(self, prefix: str) -> None:
        """A key with this lookup prefix was just made: its earlier miss no longer holds."""
        self._missing.pop(prefix, None)
        self._epoch += 1

    def _forget_refusals(self) -> None:
        """A key or tenant changed: a refusal (suspended, revoked...) may no longer hold."""
        self._refused.clear()
        self._epoch += 1

    def invalidate_key_id(self, key_id: str) -> None:
        for d, (_, p) in list(self._entries.items()):
            if p.key_id == key_id:
                self._entries.pop(d, None)
        self._forget_refusals()

    def invalidate_tenant(self, tenant_id: str) -> None:
        for d, (_, p) in list(self._entries.items()):
            if p.tenant_id == tenant_id:
                self._entries.pop(d, None)
        self._forget_refusals()
