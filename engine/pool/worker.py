"""`EngineWorker`: one device's engine in a Ray actor (engine/pool/__init__.py has the pool).

A worker owns one device (on a CPU machine: a share of its cores, `threads`), or a
tensor-parallel group's `tensor_parallel_size` devices (its engine's rank 0 here, ranks
1..N-1 processes it spawns, `threads` each), and serves every
model of the pool from one `AsyncEngine` over a `ModelPool` under its memory budget, so the
models it is asked for take turns on its device by demand. Its methods are what a gateway
replica calls through Ray:

- `generate`: an async generator (a Ray streaming generator on the caller's side) that first
  yields ``("accepted", None)`` or ``("error", exc)`` (InvalidRequest, EngineOverloaded,
  EngineDead: the same errors `EngineClient.submit` raises, nothing queued), then
  ``("out", RequestOutput)`` per step, and ``("error", exc)`` if the engine sheds or dies.
  Cancelling it (the caller's `ray.cancel`, or an `abort`) aborts the request.
- `keepalive(owner)`: a gateway replica says it is alive; the requests of an owner silent for
  `owner_ttl_s` are aborted (a replica that died leaves no orphaned work holding KV).
- `report`: what routing and placement read: models resident, adapters, queue depth and
  running work per class, KV usage, the engine's stats, and the summary of the prompt
  prefixes it holds (engine/pool/router.py `PrefixSummary`; sent only when it changed since
  the version the caller has).
- adapters (`add_lora`, `remove_lora`, `unload_lora`) and tenant weights, as `EngineAdmin`.

Nothing here imports Ray: `engine.pool.remote_worker` wraps this class as an actor.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockgate.engine.errors import EngineDead, EngineError, EngineOverloaded, InvalidRequest
from lockgate.engine.kv_cache.events import EventReport, KVEventLog
from lockgate.engine.lora_files import Adapter, LoRARequest
from lockgate.engine.pool.router import PrefixSummary
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.stats import EngineStats


class ModelFilesMissing(RuntimeError):
    """A worker's node lacks a model directory the pool serves."""


@dataclass(frozen=True)
class WorkerReport:
    """A worker's state as routing and placement see it (pickled through Ray)."""

    worker_id: str
    node: str
    pid: int
    models: dict[str, bool]                    # model -> resident on the device now
    loras: list[str]
    waiting: dict[str, int]                     # requests per class that have sent nothing
    running: dict[str, int]                     # sequences per class
    kv_used: int
    kv_total: int
    owned: int                                  # requests in flight
    capacity: int                               # models it can keep resident at once
    started: bool                               # its engine runs (false after a restart)
    at: float
    stats: EngineStats = field(repr=False, default_factory=EngineStats)
    prefix_version: int = 0                     # the PrefixSummary's version
    prefixes: bytes | None = field(repr=False, default=None)   # its keys; None: unchanged
    prefix_blocks: int = 0                      # how many it holds
    tensor_parallel_size: int = 1               # ranks of its engine (one worker however many)
    devices: int = 0                            # lockgate_device units it holds (0: none lent)
    kv_events: EventReport | None = field(repr=False, default=None)   # its KV events since the caller's
    block_size: int = 16                        # tokens per KV block (the events' hashes cover blocks)
    by_owner: dict[str, int] = field(default_factory=dict)   # requests in flight per gateway replica

    def load(self, service_class: str) -> int:
        """Work ahead of a new request of `service_class` here (every class: the step is shared)."""
        return sum(self.waiting.values()) + sum(self.running.values())


def check_model_dirs(models: dict[str, str]) -> None:
    """Every model directory is on this node (a shared filesystem, or one each node was told)."""
    missing = {n: p for n, p in models.items() if not (Path(p) / "config.json").is_file()}
    if missing:
        raise ModelFilesMissing(
            f"node {socket.gethostname()}: no model directory (config.json) at "
            + ", ".join(f"{n}={p}" for n, p in sorted(missing.items()))
            + "; pool workers read models from the same paths on every node")


def _cached_of(kv: Any) -> Callable[[], Iterable[bytes]]:
    """The hashes a KV manager's current block pool caches (a reset replaces the pool)."""
    return lambda: kv.pool.cached


def _held_of(host: Any) -> Callable[[], Iterable[bytes]]:
    """The hashes a host KV tier holds."""
    return lambda: host.entries


DEFAULT_SUMMARY_BLOCKS = 16_384     # prefix blocks a summary holds before its engine reports its KV size


class EngineWorker:
    def __init__(self, worker_id: str, models: dict[str, str], engine_kwargs: dict[str, Any],
                 *, threads: int = 1, owner_ttl_s: float = 10.0, devices: int = 0) -> None:
        if not models:
            raise ValueError("models: a worker serves at least one model")
        self.worker_id = worker_id
        self.models = dict(models)
        self.engine_kwargs = dict(engine_kwargs)
        self.threads = threads
        self.owner_ttl_s = owner_ttl_s
        self.devices = devices
        self.tensor_parallel_size = max(1, int(self.engine_kwargs.get("tensor_parallel_size", 1)))
        self.engine: Any = None
        self._owned: dict[str, str] = {}          # request id -> owner (a gateway replica)
        self._seen: dict[str, float] = {}         # owner -> last keepalive (monotonic)
        self._watch: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self.prefixes = PrefixSummary(DEFAULT_SUMMARY_BLOCKS)
        self.kv_events = KVEventLog()
        self.block_size = 16

    async def start(self) -> WorkerReport:
        """Build and start the engine (idempotent: concurrent callers, e.g. every replica after
        a restart, share one start); raises ModelFilesMissing naming the paths."""
        async with self._starting:
            await self._start()
        return self.report()

    async def _start(self) -> None:
        if self.engine is None:
            check_model_dirs(self.models)
            import torch

            from lockgate.engine.async_engine import AsyncEngine

            torch.set_num_threads(self.threads)
            (first, path), *rest = self.models.items()
            kw = dict(self.engine_kwargs)
            if self.tensor_parallel_size > 1:     # each rank its share, not the cores all over
                kw.setdefault("num_threads", self.threads)
            if rest:
                kw["models"] = {n: p for n, p in rest}
            engine = AsyncEngine(path, served_model_name=first, **kw)
            await engine.start()
            self.engine = engine
            self._listen(engine)
            total = engine.stats().kv.total
            if total > 0:      # as many prefix blocks as its cache holds (capped: a report's size)
                self.prefixes.capacity = min(total, 4 * DEFAULT_SUMMARY_BLOCKS)
            self._watch = asyncio.get_running_loop().create_task(self._watchdog())

    def _listen(self, engine: Any) -> None:
        """Every model's block pool tells this worker's event log what it caches."""
        self.kv_events = KVEventLog()          # a fresh engine: a fresh epoch, an empty cache
        self.block_size = int(engine.config.block_size)
        core = engine.core
        for c in getattr(core, "cores", {"": core}).values():
            kv = c.kv        # a request's hashes are salted by the core's canonical name
            kv.pool.listener = self.kv_events.listener(c.model_name, _cached_of(kv))
            if kv.host is not None:
                kv.host.listener = self.kv_events.listener(c.model_name, _held_of(kv.host), tier="host")

    def pid(self) -> int:
        return os.getpid()

    def held_devices(self) -> int:
        """The devices this worker holds (as Ray assigned them, in the actor)."""
        return self.devices

    # -- requests --------------------------------------------------------------------------------
    async def generate(self, owner: str, prompt: Any, params: SamplingParams, request_id: str,
                       kwargs: dict[str, Any], prefix: list[bytes] | None = None,
                       ) -> AsyncIterator[tuple[str, Any]]:
        """`prefix`: the router's chain of the prompt (engine/pool/router.py), recorded in
        this worker's prefix summary once the request is accepted."""
        if self.engine is None:
            yield ("error", EngineDead(f"worker {self.worker_id} is not started"))
            return
        self._seen.setdefault(owner, time.monotonic())
        try:
            stream = self.engine.submit(prompt, params, request_id, **kwargs)
        except (InvalidRequest, EngineOverloaded, EngineDead) as exc:
            yield ("error", exc)
            return
        self._owned[request_id] = owner
        if prefix:
            self.prefixes.add(prefix)
        try:
            yield ("accepted", None)
            async for out in stream:
                yield ("out", out)
        except EngineError as exc:          # a shed, a dead engine, an adapter that failed
            yield ("error", exc)
        except Exception as exc:  # noqa: BLE001 - any other failure ends the request, told
            yield ("error", EngineDead(f"worker {self.worker_id}: {type(exc).__name__}: {exc}"))
        finally:
            stream.close()       # aborts the request unless it finished
            self._owned.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        if self.engine is not None:
            await self.engine.abort(request_id)

    async def keepalive(self, owner: str) -> None:
        self._seen[owner] = time.monotonic()

    async def _watchdog(self) -> None:
        """Abort the requests of owners silent for `owner_ttl_s` (their replica died)."""
        while True:
            await asyncio.sleep(max(0.1, self.owner_ttl_s / 3))
            now = time.monotonic()
            for rid, owner in list(self._owned.items()):
                if now - self._seen.get(owner, now) > self.owner_ttl_s:
                    await self.abort(rid)

    # -- state ----------------------------------------------------------------------------------
    def report(self, prefix_version: int = -1, kv_epoch: str | None = None,
               kv_after: int | None = None) -> WorkerReport:
        """`prefix_version`: the summary version the caller holds; its keys are sent only
        when this worker's differs. `kv_epoch`, `kv_after`: the KV events the caller applied
        (engine/pool/kv_index.py `cursor`); None: it wants none."""
        s: EngineStats = self.engine.stats() if self.engine is not None else EngineStats()
        capacity = len(self.models)
        if s.pool is not None:
            resident = {n: m.resident for n, m in s.pool.models.items()}
            biggest = max((m.memory_bytes for m in s.pool.models.values()), default=0)
            total = s.pool.memory.get("total_bytes", 0)
            if biggest > 0 and total > 0:
                capacity = max(1, min(len(self.models), total // biggest))
        else:
            resident = {n: self.engine is not None for n in self.models}
        return WorkerReport(
            worker_id=self.worker_id, node=socket.gethostname(), pid=os.getpid(),
            models=resident, loras=sorted(self.engine.loras) if self.engine is not None else [],
            waiting=dict(s.waiting_requests), running=dict(s.running),
            kv_used=s.kv.used, kv_total=s.kv.total, owned=len(self._owned), capacity=capacity,
            started=self.engine is not None, at=time.time(),
            stats=s, prefix_version=self.prefixes.version,
            prefixes=None if prefix_version == self.prefixes.version else self.prefixes.packed(),
            prefix_blocks=len(self.prefixes), tensor_parallel_size=self.tensor_parallel_size,
            devices=self.held_devices(), block_size=self.block_size,
            by_owner=dict(Counter(self._owned.values())),
            kv_events=None if kv_after is None else self.kv_events.report(kv_epoch, kv_after))

    def kv_cached(self) -> dict[str, set[bytes]]:
        """The block hashes its caches hold now, by tier (what the router's index should say)."""
        out: dict[str, set[bytes]] = {}
        for (_, tier), hashes in self.kv_events.cached().items():
            out.setdefault(tier, set()).update(hashes)
        return out

    # -- admin ------------------------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        return await self.engine.add_lora(lora_request)

    async def remove_lora(self, name: str) -> bool:
        return bool(self.engine.remove_lora(name))

    async def unload_lora(self, name: str) -> bool:
        return bool(self.engine.unload_lora(name))

    async def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.engine.set_tenant_weight(tenant, weight)

    async def purge_tenant(self, tenant: str) -> None:
        if self.engine is not None:
            self.engine.purge_tenant(tenant)

    async def shutdown(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self.engine is not None:
            await self.engine.shutdown()
            self.engine = None
