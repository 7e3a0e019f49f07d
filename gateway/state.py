"""What one gateway process holds: settings, the served models and their adapters, the
database, the limiter, the usage writer, the key cache and the metrics."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine as SAEngine
from sqlalchemy.ext.asyncio import async_sessionmaker

from engine import AsyncEngine, LoRAError, LoRARequest
from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.settings import Settings
from tenancy import service
from tenancy.errors import AuthError, Invalid
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
    parent: str | None = None      # an adapter's base model; `engine` is then a BoundEngine


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


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """An adapter's row, as this replica last read it."""

    id: str
    name: str
    base_model: str
    owner_tenant_id: str | None
    path: str                      # relative to the adapter root
    rank: int
    targets: tuple[str, ...]
    created: int

    @classmethod
    def from_row(cls, row: Any) -> AdapterInfo:
        return cls(row.id, row.name, row.base_model, row.owner_tenant_id, row.path, row.rank,
                   tuple(row.targets), int(row.created_at.timestamp()))


class BoundEngine:
    """A base model's engine bound to one adapter: what a request for the adapter submits
    to (`submit(..., model=<adapter>)`); everything else is the base engine's."""

    def __init__(self, engine: AsyncEngine, adapter: str) -> None:
        self.engine = engine
        self.adapter = adapter

    def submit(self, *args: Any, **kwargs: Any) -> Any:
        if self.adapter not in self.engine.loras:      # deleted since it was resolved
            raise APIError(404, f"The model `{self.adapter}` does not exist or you do not have "
                           "access to it.", param="model", code="model_not_found")
        return self.engine.submit(*args, model=self.adapter, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class AdapterCatalog:
    """The adapters as this replica knows them. Rows are read from the database by name
    and kept `ttl` seconds (a miss 1 s, at most `MAX_MISSES` of them), so an adapter registered on another replica is
    found on first use and a deleted one stops resolving everywhere within `ttl`. The
    engine reads an adapter (`add_lora`) on its first use here; `sweep()` drops those whose
    row is gone. LoRARequest ids are this process's own: one per adapter row."""

    MISS_TTL = 1.0
    MAX_MISSES = 10_000   # names that resolved to nothing, remembered (any tenant can send any)

    def __init__(self, state: AppState, ttl: float) -> None:
        self.state = state
        self.ttl = ttl
        self._entries: dict[str, tuple[float, AdapterInfo]] = {}
        self._missing: dict[str, float] = {}
        self._lookups: dict[str, asyncio.Future] = {}
        self._adding: dict[tuple[str, str], asyncio.Future] = {}
        self._int_ids: dict[str, int] = {}
        self._next_int_id = itertools.count(1)
        self.deleting: set[str] = set()

    # -- rows ---------------------------------------------------------------------------------
    def put(self, info: AdapterInfo) -> None:
        self._entries[info.name] = (time.monotonic(), info)
        self._missing.pop(info.name, None)

    def drop(self, name: str) -> None:
        self._entries.pop(name, None)
        self._missing.pop(name, None)

    def mark_missing(self, name: str) -> None:
        """Deleted here, or not found: a miss for `MISS_TTL`. The misses are bounded: past
        `MAX_MISSES` (a client sending made-up model names) they are forgotten at once."""
        self._entries.pop(name, None)
        if len(self._missing) >= self.MAX_MISSES:
            self._missing.clear()
        self._missing[name] = time.monotonic()

    async def lookup(self, name: str) -> AdapterInfo | None:
        """The adapter named `name`, from the cache while fresh, else from the database
        (concurrent lookups of one name share one query)."""
        now = time.monotonic()
        hit = self._entries.get(name)
        if hit is not None and now - hit[0] <= self.ttl:
            return hit[1]
        missed = self._missing.get(name)
        if missed is not None and now - missed <= min(self.MISS_TTL, self.ttl):
            return None
        fut = self._lookups.get(name)
        if fut is None:
            fut = asyncio.ensure_future(self._read(name))
            self._lookups[name] = fut
            fut.add_done_callback(lambda _: self._lookups.pop(name, None))
        return await asyncio.shield(fut)

    async def _read(self, name: str) -> AdapterInfo | None:
        assert self.state.sessions is not None
        async with self.state.sessions() as session:
            row = await service.find_adapter(session, name)
        if row is None:
            self.mark_missing(name)
            return None
        info = AdapterInfo.from_row(row)
        self.put(info)
        return info

    async def listing(self, tenant_id: str) -> list[AdapterInfo]:
        """A tenant's own and the public adapters, read now (and cached by name)."""
        assert self.state.sessions is not None
        async with self.state.sessions() as session:
            rows = await service.list_tenant_adapters(session, tenant_id)
        infos = [AdapterInfo.from_row(r) for r in rows]
        for info in infos:
            self.put(info)
        return infos

    # -- the engines ------------------------------------------------------------------------------
    def lora_request(self, adapter_id: str, name: str, path: str) -> LoRARequest:
        """The engine's request for the adapter row `adapter_id`; `path` (relative to the
        adapter root) checked against the root again."""
        int_id = self._int_ids.get(adapter_id)
        if int_id is None:
            int_id = self._int_ids[adapter_id] = next(self._next_int_id)
        root = self.state.settings.adapter_root
        assert root is not None
        _, real = service.adapter_path(root, path)
        return LoRARequest(name, int_id, str(real))

    def forget_int_id(self, adapter_id: str) -> None:
        self._int_ids.pop(adapter_id, None)

    def is_current(self, engine: Any, name: str, adapter_id: str | None) -> bool:
        """Whether `engine` serves `name` as the adapter row `adapter_id`."""
        known = getattr(engine, "loras", {}).get(name)
        return known is not None and known.lora_int_id == self._int_ids.get(adapter_id or "")

    def remove_stale(self, engine: Any, name: str, adapter_id: str | None) -> None:
        """Take `name` off `engine` unless it is the row `adapter_id` (LoRAError while
        requests still use it)."""
        if name in getattr(engine, "loras", {}) and not self.is_current(engine, name, adapter_id):
            engine.remove_lora(name)

    async def register(self, entry: ModelEntry, info: AdapterInfo) -> None:
        """Have `entry`'s engine serve the adapter (read on a worker thread, once however
        many requests ask at the same time). Raises LoRAError or Invalid (its path)."""
        engine = entry.engine
        if self.is_current(engine, info.name, info.id):
            return
        key = (entry.name, info.name)
        fut = self._adding.get(key)
        if fut is None:
            self.remove_stale(engine, info.name, info.id)
            fut = asyncio.ensure_future(engine.add_lora(self.lora_request(info.id, info.name, info.path)))
            self._adding[key] = fut
            fut.add_done_callback(lambda _: self._adding.pop(key, None))
        await asyncio.shield(fut)

    async def sweep(self) -> None:
        """Take adapters whose row is gone (or replaced) off this replica's engines."""
        served = {(m.name, name): req for m in self.state.models.values()
                  for name, req in getattr(m.engine, "loras", {}).items()}
        if not served:
            return
        assert self.state.sessions is not None
        async with self.state.sessions() as session:
            ids = await service.adapter_ids_by_name(session, {name for _, name in served})
        for (model, name), req in served.items():
            if self._int_ids.get(ids.get(name, "")) == req.lora_int_id:
                continue
            self.drop(name)
            try:
                self.state.models[model].engine.remove_lora(name)
            except LoRAError:
                pass                      # requests still use it: the next sweep tries again

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.ttl)
            try:
                await self.sweep()
            except Exception:  # noqa: BLE001 - the next sweep tries again
                logger.warning("adapter sweep failed", exc_info=True)


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
        self.adapters = AdapterCatalog(self, settings.adapter_cache_ttl_s)
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

    # -- adapters ---------------------------------------------------------------------------
    def adapter_visible(self, principal: Principal, info: AdapterInfo) -> bool:
        """A tenant uses its own and the public adapters on a base model served here; a
        tenant with a model list needs the adapter's or its base model's name in it, one
        without sees public adapters of public base models and every adapter it owns."""
        if info.owner_tenant_id not in (None, principal.tenant_id) or info.name in self.adapters.deleting:
            return False
        base = self.models.get(info.base_model)
        if base is None:
            return False
        if principal.models is not None:
            return info.name in principal.models or base.name in principal.models
        return info.owner_tenant_id is not None or not base.private

    def adapter_entry(self, info: AdapterInfo) -> ModelEntry:
        base = self.models[info.base_model]
        return ModelEntry(info.name, base.path, BoundEngine(base.engine, info.name),  # type: ignore[arg-type]
                          private=info.owner_tenant_id is not None, created=info.created,
                          parent=base.name)

    async def visible_adapters(self, principal: Principal) -> list[ModelEntry]:
        assert principal.tenant_id is not None
        infos = await self.adapters.listing(principal.tenant_id)
        return [self.adapter_entry(i) for i in infos if self.adapter_visible(principal, i)]

    async def find_model(self, principal: Principal, name: str) -> ModelEntry | None:
        """A served model or an adapter `principal` may use, by name; None otherwise."""
        entry = self.models.get(name)
        if entry is not None:
            return entry if entry in self.visible_models(principal) else None
        if principal.tenant_id is None:
            return None
        info = await self.adapters.lookup(name)
        if info is None or not self.adapter_visible(principal, info):
            return None
        return self.adapter_entry(info)

    async def use_adapter(self, entry: ModelEntry) -> None:
        """Make sure the engine serves the adapter `entry` names (lazily, on first use)."""
        info = await self.adapters.lookup(entry.name)
        if info is None or entry.parent is None:
            raise APIError(404, f"The model `{entry.name}` does not exist or you do not have "
                           "access to it.", param="model", code="model_not_found")
        try:
            await self.adapters.register(self.models[entry.parent], info)
        except (LoRAError, Invalid) as exc:
            logger.error("adapter %s could not be served here: %s", entry.name, exc)
            raise APIError(503, f"The adapter `{entry.name}` cannot be served by this replica "
                           "right now.", code="adapter_unavailable",
                           headers={"retry-after": "5"}) from None

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
