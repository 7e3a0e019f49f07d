"""What one gateway process holds: settings, the served models, the database, the limiter,
the usage writer, the key cache and the metrics."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine as SAEngine
from sqlalchemy.ext.asyncio import async_sessionmaker

from engine import AsyncEngine
from gateway.metrics import Metrics
from gateway.settings import Settings
from tenancy import service
from tenancy.errors import AuthError
from tenancy.limiter import Lease, Limiter
from tenancy.service import Principal, UsageWriter

logger = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    name: str
    path: Path
    engine: AsyncEngine
    private: bool = False          # served only to tenants that list it
    created: int = field(default_factory=lambda: int(time.time()))


class KeyCache:
    """Principals by a digest of the presented key. An entry younger than `ttl` is used as
    is; one between `ttl` and `2 x ttl` old is used while one background lookup refreshes
    it; older ones are looked up before use. Concurrent lookups of one key share a single
    database query. So a revoked key stops working on every replica within `2 x ttl` plus
    one lookup, and a busy key never makes its requests wait for the database. The
    plaintext is not kept."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._entries: dict[bytes, tuple[float, Principal]] = {}
        self._inflight: dict[bytes, asyncio.Future] = {}

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.sha256(key.encode()).digest()

    def get(self, key: str) -> Principal | None:
        hit = self._entries.get(self._digest(key))
        if hit is None or time.monotonic() - hit[0] > self.ttl:
            return None
        return hit[1]

    def put(self, key: str, principal: Principal) -> None:
        if len(self._entries) > 100_000:
            self._entries.clear()
        self._entries[self._digest(key)] = (time.monotonic(), principal)

    async def resolve(self, key: str, lookup, spawn) -> Principal:
        """The principal for `key`, fresh enough (see the class docstring). `lookup(key)`
        queries the database; `spawn(coro)` runs a background refresh."""
        d = self._digest(key)
        hit = self._entries.get(d)
        age = time.monotonic() - hit[0] if hit else None
        if hit is not None and age <= self.ttl:
            return hit[1]
        fut = self._inflight.get(d)
        if hit is not None and age <= 2 * self.ttl:
            if fut is None:
                spawn(self._refresh(d, key, lookup, self._start(d)))
            return hit[1]
        if fut is None:
            fut = self._start(d)
            await self._refresh(d, key, lookup, fut)
        return await asyncio.shield(fut)

    def _start(self, d: bytes) -> asyncio.Future:
        """Mark a lookup of `d` as under way (before it starts, so no second one begins)."""
        fut = asyncio.get_running_loop().create_future()
        self._inflight[d] = fut
        return fut

    async def _refresh(self, d: bytes, key: str, lookup, fut: asyncio.Future) -> None:
        """Look `key` up; the result or the error goes to `fut` (never raised here)."""
        try:
            principal = await lookup(key)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on fut
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


class AppState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models: dict[str, ModelEntry] = {}
        self.db: SAEngine | None = None
        self.sessions: async_sessionmaker | None = None
        self.limiter: Limiter | None = None
        self.usage: UsageWriter | None = None
        self.pepper: bytes = b""
        self.keys = KeyCache(settings.key_cache_ttl_s)
        self.metrics = Metrics(self.engine_stats)
        self.draining = False
        self.ready = False
        self.inflight: dict[str, Lease] = {}
        self._touched: dict[str, float] = {}
        self._background: set[asyncio.Task] = set()

    # -- engines ----------------------------------------------------------------------------
    def engine_stats(self) -> list[tuple[str, dict]]:
        return [(name, m.engine.stats()) for name, m in self.models.items() if m.engine.core is not None]

    def push_weight(self, tenant_id: str, weight: float) -> None:
        for m in self.models.values():
            if m.engine.tenant_weights.get(tenant_id) != weight:
                m.engine.set_tenant_weight(tenant_id, weight)

    def visible_models(self, principal: Principal) -> list[ModelEntry]:
        allowed = principal.models
        return [m for m in self.models.values()
                if (m.name in allowed if allowed is not None else not m.private)]

    # -- keys -------------------------------------------------------------------------------
    async def _lookup_key(self, key: str) -> Principal:
        assert self.sessions is not None
        async with self.sessions() as session:
            return await service.authenticate(session, key, self.pepper)

    async def authenticate(self, key: str) -> Principal:
        principal = await self.keys.resolve(key, self._lookup_key, self.spawn)
        if principal.expires_at is not None and principal.expires_at <= datetime.now(UTC):
            raise AuthError("expired")
        self._touch(principal.key_id)
        return principal

    def _touch(self, key_id: str) -> None:
        """Record last use at most once a minute per key, off the request's path."""
        now = time.monotonic()
        if now - self._touched.get(key_id, -1e9) < 60:
            return
        self._touched[key_id] = now

        async def touch() -> None:
            try:
                assert self.sessions is not None
                async with self.sessions() as session:
                    await service.touch_key(session, key_id, datetime.now(UTC))
            except Exception:  # noqa: BLE001 - last-used is best effort
                logger.warning("could not record last use of key %s", key_id, exc_info=True)

        self.spawn(touch())

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
