"""`AppState`: what one gateway process serves with (settings, models, database, limiter,
usage writer, key cache, adapter catalog, metrics), built whole at start-up; `ModelEntry`;
`Lifecycle` (ready, draining, the admitted runs a shutdown waits for and then cuts);
`database_unavailable`, the one 503 for a database that does not answer."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from fastapi import Request
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine as SAEngine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.engine import (
    Adapter,
    EngineStats,
    LoRAError,
    LoRARequest,
    Prompt,
    RequestStream,
    SamplingParams,
    ServedEngine,
)
from lockgate.gateway.adapter_catalog import AdapterCatalog, AdapterInfo
from lockgate.gateway.errors import APIError
from lockgate.gateway.key_cache import KeyCache
from lockgate.gateway.metrics import Metrics
from lockgate.gateway.model_catalog import ModelInfo
from lockgate.gateway.settings import Settings
from lockgate.gateway.tokenize_pool import TokenizePool
from lockgate.tenancy import api_keys, auth
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import AuthError, Invalid
from lockgate.tenancy.limiter import Lease, Limiter
from lockgate.tenancy.usage.refusals import RefusalCounter
from lockgate.tenancy.usage.writer import UsageWriter
from lockgate.tenancy.visibility import adapter_visible, model_visible

logger = logging.getLogger(__name__)

def database_unavailable() -> APIError:
    return APIError(503, "The database is unavailable; retry shortly.", code="database_unavailable",
                    headers={"retry-after": "2"})


def is_database_down(exc: BaseException) -> bool:
    """A database that is down or does not answer (refused or dropped connections, a bounded
    wait run out), not a statement it refused."""
    if isinstance(exc, (OperationalError, OSError, TimeoutError)):
        return True
    return isinstance(exc, DBAPIError) and (exc.connection_invalidated
                                            or isinstance(exc.orig, (OSError, TimeoutError)))


@dataclass
class ModelEntry:
    name: str
    path: Path
    engine: ServedEngine
    info: ModelInfo                # tokenizer, chat template, context (an adapter's: its base's)
    private: bool = False          # served only to tenants that list it
    created: int = field(default_factory=lambda: int(time.time()))
    parent: str | None = None      # an adapter's base model; `engine` is then a BoundEngine


class BoundEngine(ServedEngine):
    """A base model's engine bound to one adapter: what a request for the adapter submits
    to (`submit(..., model=<adapter>)`, 404 once the adapter is gone); everything else is
    the base engine's."""

    def __init__(self, engine: ServedEngine, adapter: str) -> None:
        self.engine = engine
        self.adapter = adapter

    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
               **kwargs: Any) -> RequestStream:
        if self.adapter not in self.engine.loras:      # deleted since it was resolved
            raise APIError(404, f"The model `{self.adapter}` does not exist or you do not have "
                           "access to it.", param="model", code="model_not_found")
        return self.engine.submit(prompt, sampling_params, request_id, model=self.adapter, **kwargs)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def is_ready(self) -> bool:
        return self.engine.is_ready

    async def start(self) -> None:
        await self.engine.start()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        return await self.engine.add_lora(lora_request)

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def unload_lora(self, name: str) -> bool:
        return self.engine.unload_lora(name)

    @property
    def loras(self) -> dict[str, LoRARequest]:
        return self.engine.loras

    @property
    def tenant_weights(self) -> dict[str, float]:
        return self.engine.tenant_weights

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.engine.set_tenant_weight(tenant, weight)


class Cuttable(Protocol):
    def cut(self, reason: str) -> None: ...


@dataclass(slots=True)
class Lifecycle:
    """Whether this process serves: `ready` once start-up has finished, `draining` from the
    shutdown signal on (new requests are then refused with 503), and `runs`, the admitted
    requests not yet ended (`jobs.RequestRun`s). It exists before the `AppState` does, so a
    signal during start-up is not lost."""

    ready: bool = False
    draining: bool = False
    runs: set[Cuttable] = field(default_factory=set)

    async def drain(self, timeout_s: float, grace_s: float) -> bool:
        """Draining: wait up to `timeout_s` for the runs to end; cut those left (each ends
        with an error to its client and its `cancelled` usage row) and give them `grace_s`
        to write their rows. True when none is left."""
        self.draining = True
        if await self._wait_idle(timeout_s):
            return True
        logger.warning("%d requests still running after %g s of draining: cut", len(self.runs), timeout_s)
        for run in list(self.runs):
            run.cut("shutdown")
        if await self._wait_idle(grace_s):
            return True
        logger.error("%d cut requests had not ended %g s later", len(self.runs), grace_s)
        return False

    async def _wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.runs


@dataclass(slots=True, eq=False)
class AppState:
    """Everything one gateway process serves with. `app.lifespan` builds the parts, then
    this at once, so every field is there from the first request on."""

    settings: Settings
    models: dict[str, ModelEntry]
    db: SAEngine
    sessions: async_sessionmaker[AsyncSession]
    limiter: Limiter
    usage: UsageWriter
    pepper: bytes
    lifecycle: Lifecycle
    keys: KeyCache = field(init=False)
    adapters: AdapterCatalog = field(init=False)
    metrics: Metrics = field(init=False)
    tokenize: TokenizePool = field(init=False)   # large prompts tokenized off the loop
    refusals: RefusalCounter = field(init=False)  # 429s by limit, flushed in batches (app.lifespan)
    inflight: dict[str, Lease] = field(init=False, default_factory=dict)     # job id -> its lease
    _touched: dict[str, float] = field(init=False, default_factory=dict)
    _background: set[asyncio.Task[Any]] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        s = self.settings
        self.keys = KeyCache(s.key_cache_ttl_s)
        self.adapters = AdapterCatalog(self.sessions, s.resolved_adapter_root(), self.models,
                                       s.adapter_cache_ttl_s)
        self.metrics = Metrics(self.engine_stats)
        # its worker processes start on the first large prompt, never at start-up
        self.tokenize = TokenizePool(workers=s.tokenizer_workers, inline_chars=s.tokenizer_inline_chars)
        self.refusals = RefusalCounter(self.sessions, interval_s=s.refusal_flush_interval_s,
                                       timeout_s=s.database_timeout_s,
                                       max_buckets=s.refusal_max_buckets)

    @property
    def ready(self) -> bool:
        return self.lifecycle.ready

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    # -- engines ----------------------------------------------------------------------------
    def engine_stats(self) -> list[tuple[str, EngineStats]]:
        return [(name, m.engine.stats()) for name, m in self.models.items() if m.engine.is_ready]

    def push_weight(self, tenant_id: str, weight: float) -> None:
        for m in self.models.values():
            if m.engine.tenant_weights.get(tenant_id) != weight:
                m.engine.set_tenant_weight(tenant_id, weight)

    def visible_models(self, principal: Principal) -> list[ModelEntry]:
        return [m for m in self.models.values() if model_visible(principal, m.name, private=m.private)]

    # -- adapters ---------------------------------------------------------------------------
    def adapter_visible(self, principal: Principal, info: AdapterInfo) -> bool:
        """Whether `principal` may use the adapter: on a base model served here, not being
        deleted here, and allowed by `tenancy.visibility.adapter_visible`."""
        base = self.models.get(info.base_model)
        if base is None or info.name in self.adapters.deleting:
            return False
        return adapter_visible(principal, info.name, owner_tenant_id=info.owner_tenant_id,
                               base_model=base.name, base_private=base.private)

    def adapter_entry(self, info: AdapterInfo) -> ModelEntry:
        base = self.models[info.base_model]
        return ModelEntry(info.name, base.path, BoundEngine(base.engine, info.name), base.info,
                          private=info.owner_tenant_id is not None, created=info.created,
                          parent=base.name)

    async def visible_adapters(self, principal: Principal) -> list[ModelEntry]:
        """The adapters `principal` may use (none for a key of no tenant, as in `find_model`)."""
        if principal.tenant_id is None:
            return []
        infos = await self.adapters.listing(principal.tenant_id)
        return [self.adapter_entry(i) for i in infos if self.adapter_visible(principal, i)]

    async def find_model(self, principal: Principal, name: str) -> ModelEntry | None:
        """A served model or an adapter `principal` may use, by name; None otherwise."""
        entry = self.models.get(name)
        if entry is not None:
            return entry if model_visible(principal, entry.name, private=entry.private) else None
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
        """A key not in the cache needs the database: down, the request is refused (503)."""
        try:
            async with self.sessions() as session:
                return await auth.authenticate(session, key, self.pepper)
        except Exception as exc:
            if is_database_down(exc):
                logger.warning("key lookup: the database is unavailable: %r", exc)
                raise database_unavailable() from None
            raise

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
                async with self.sessions() as session:
                    await api_keys.touch_key(session, key_id, datetime.now(UTC))
            except Exception:  # any failure, logged: last-used is best effort
                logger.warning("could not record last use of key %s", key_id, exc_info=True)

        self.spawn(touch())

    def spawn(self, coro: Any) -> None:
        """Run `coro` in the background; `wait_background` waits for what is left at shutdown."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def close(self) -> None:
        """Stop what this state itself runs: the tokenizer's worker processes."""
        await self.tokenize.close()


def app_state(request: Request) -> AppState:
    """The state of the app serving `request` (set by `app.lifespan` before any request)."""
    state: AppState = request.app.state.lockgate
    return state
