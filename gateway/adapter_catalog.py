"""`AdapterCatalog`: the LoRA adapters as this replica knows them (rows read by name and cached,
engines told on first use, a sweep for deleted ones), and registering or deleting one, engine
and row together."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.engine import LoRAError, LoRARequest
from lockgate.tenancy import adapters
from lockgate.tenancy.models import new_adapter_id

if TYPE_CHECKING:
    from lockgate.gateway.model_directory import ModelEntry

logger = logging.getLogger(__name__)


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


class AdapterRefused(Exception):
    """The engine could not read the adapter being registered (`cause` says why)."""

    def __init__(self, cause: LoRAError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class AdapterCatalog:
    """The adapters as this replica knows them. Rows are read from the database by name
    and kept `ttl` seconds (a miss 1 s, at most `MAX_MISSES` of them), so an adapter
    registered on another replica is found on first use and a deleted one stops resolving
    everywhere within `ttl`. The engine reads an adapter (`add_lora`) on its first use here;
    `sweep()` drops those whose row is gone. LoRARequest ids are this process's own: one per
    adapter row."""

    MISS_TTL = 1.0
    MAX_MISSES = 10_000   # names that resolved to nothing, remembered (any tenant can send any)

    def __init__(self, sessions: async_sessionmaker[AsyncSession], adapter_root: Path,
                 models: Mapping[str, ModelEntry], ttl: float) -> None:
        self.sessions = sessions
        self.adapter_root = adapter_root
        self.models = models
        self.ttl = ttl
        self._entries: dict[str, tuple[float, AdapterInfo]] = {}
        self._missing: dict[str, float] = {}
        self._lookups: dict[str, asyncio.Future[AdapterInfo | None]] = {}
        self._adding: dict[tuple[str, str], asyncio.Future[Any]] = {}
        self._int_ids: dict[str, int] = {}
        self._next_int_id = itertools.count(1)
        self.deleting: set[str] = set()     # names being deleted here: resolve to nothing

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
        async with self.sessions() as session:
            row = await adapters.find_adapter(session, name)
        if row is None:
            self.mark_missing(name)
            return None
        info = AdapterInfo.from_row(row)
        self.put(info)
        return info

    async def listing(self, tenant_id: str) -> list[AdapterInfo]:
        """A tenant's own and the public adapters, read now (and cached by name)."""
        async with self.sessions() as session:
            rows = await adapters.list_tenant_adapters(session, tenant_id)
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
        _, real = adapters.adapter_path(self.adapter_root, path)
        return LoRARequest(name, int_id, str(real))

    def forget_int_id(self, adapter_id: str) -> None:
        self._int_ids.pop(adapter_id, None)

    def is_current(self, engine: Any, name: str, adapter_id: str | None) -> bool:
        """Whether `engine` serves `name` as the adapter row `adapter_id`."""
        known = engine.loras.get(name)
        return known is not None and known.lora_int_id == self._int_ids.get(adapter_id or "")

    def remove_stale(self, engine: Any, name: str, adapter_id: str | None) -> None:
        """Take `name` off `engine` unless it is the row `adapter_id` (the engine's
        AdapterInUse while requests still use it)."""
        if name in engine.loras and not self.is_current(engine, name, adapter_id):
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
        served = {(m.name, name): req for m in self.models.values()
                  for name, req in m.engine.loras.items()}
        if not served:
            return
        async with self.sessions() as session:
            ids = await adapters.adapter_ids_by_name(session, {name for _, name in served})
        for (model, name), req in served.items():
            if self._int_ids.get(ids.get(name, "")) == req.lora_int_id:
                continue
            self.drop(name)
            with contextlib.suppress(LoRAError):      # requests still use it: the next sweep tries again
                self.models[model].engine.remove_lora(name)

    async def watch(self) -> None:
        """Sweep every `ttl` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.ttl)
            try:
                await self.sweep()
            except Exception:  # any failure, logged: the next sweep tries again
                logger.warning("adapter sweep failed", exc_info=True)

    # -- registering and deleting ------------------------------------------------------------------
    async def create(self, session: AsyncSession, base: ModelEntry, *, name: str, path: str,
                     owner_tenant_id: str | None, actor: str) -> Any:
        """Register a new adapter on `base`: check the path and the name, have the engine read
        it, then insert the row; if the insert fails the engine forgets the adapter again, so
        nothing is left half-registered. Returns the row. Raises Invalid or Conflict (the
        request), the engine's AdapterInUse (a deleted namesake still runs requests here)
        or AdapterRefused (the engine cannot read it)."""
        adapter_id = new_adapter_id()
        rel, _ = adapters.adapter_path(self.adapter_root, path)
        await adapters.check_new_adapter(session, name=name, owner_tenant_id=owner_tenant_id)
        self.remove_stale(base.engine, name, None)   # a deleted namesake, still served
        try:
            adapter = await base.engine.add_lora(self.lora_request(adapter_id, name, rel))
        except LoRAError as exc:
            self.forget_int_id(adapter_id)
            raise AdapterRefused(exc) from None
        try:
            row = await adapters.create_adapter(
                session, adapter_id=adapter_id, name=name, base_model=base.name,
                owner_tenant_id=owner_tenant_id, path=rel, rank=adapter.rank,
                targets=list(adapter.targets), actor=actor)
        except BaseException:
            base.engine.remove_lora(name)
            self.forget_int_id(adapter_id)
            raise
        self.put(AdapterInfo.from_row(row))
        return row

    async def delete(self, session: AsyncSession, row: Any, *, actor: str) -> None:
        """Take the adapter `row` off this replica's engine (the engine's AdapterInUse while
        requests use it), then delete the row; it resolves to nothing here from the start,
        and on other replicas within `ttl`."""
        name, entry = row.name, self.models.get(row.base_model)
        self.deleting.add(name)
        try:
            if entry is not None:
                self.remove_stale(entry.engine, name, None)
            await adapters.delete_adapter(session, row.id, actor=actor)
            self.mark_missing(name)
            self.forget_int_id(row.id)
        finally:
            self.deleting.discard(name)
