"""The gateway replica's side of the pool: `Pool` (the workers, their reports, routing and
placement) and `PoolEngine`, one model's `ServedEngine` whose requests run on the workers.

Every Ray call is bounded by `call_timeout_s` (a report, an acceptance, an admin call) except
the wait for a request's next output, which the gateway's `request_timeout_s` bounds (a
queued request may rightly wait long for its first token). A worker that dies mid-request:
a request that had sent nothing is retried once on another worker; one that had sent tokens
ends with `EngineDead` (the gateway's error event and `error` row, the tokens sent billed).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any

from lockgate.engine.client import Prompt, RequestStream
from lockgate.engine.errors import EngineDead
from lockgate.engine.lora_files import Adapter, LoRARequest
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.pool.router import Router, prefix_chain, unpack_summary
from lockgate.engine.pool.worker import WorkerReport
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.stats import EngineStats, summed_stats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolConfig:
    address: str                        # "auto" (a local Ray), "HOST:PORT" or "ray://HOST:PORT"
    models: dict[str, str]              # name -> directory, the same path on every node
    engine_kwargs: dict[str, Any]
    namespace: str = "lockgate"
    workers: int | None = None          # None: one per device the cluster advertises
    threads: int = 1                    # CPU threads per worker
    call_timeout_s: float = 30.0
    report_interval_s: float = 0.5
    owner_ttl_s: float = 10.0
    start_timeout_s: float = 300.0      # a worker's first start loads its models


class Pool:
    """The workers as this replica sees them; one per process, shared by its PoolEngines."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.owner = f"gw-{secrets.token_hex(6)}"
        self.router = Router()
        self.names: list[str] = []
        self.handles: dict[str, Any] = {}
        self.reports: dict[str, WorkerReport] = {}
        self.down: set[str] = set()
        self.assigned: dict[str, list[str]] = {}
        self.inflight: Counter[str] = Counter()
        self.restarts: Counter[str] = Counter()            # worker restarts this replica saw
        self.decisions: list[dict] = []                      # placement's recent, with reasons
        self.placement: Any = None
        self.failures: tuple[type[BaseException], ...] = ()
        self._poller: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._restarting: dict[str, asyncio.Task[None]] = {}
        self._prefix_versions: dict[str, int] = {}   # worker -> its prefix summary's version held
        # pool-wide state every worker must hold, sent again to one that restarts
        self.adapters: dict[str, LoRARequest] = {}
        self.tenant_weights: dict[str, float] = {}
        self._started = False
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        async with self._lock:
            if self._started:
                return
            await self._start()
            self._started = True

    async def _start(self) -> None:
        from lockgate.engine.pool import remote

        c = self.config
        resources = await asyncio.to_thread(remote.connect, c.address, c.namespace)
        self.failures = remote.actor_failures()
        devices = int(resources.get(remote.DEVICE, 0))
        n = c.workers or max(1, devices)
        self.names = [f"lockgate-worker-{i}" for i in range(n)]
        for name in self.names:
            self.handles[name] = remote.worker_handle(
                name, c.namespace, name, c.models, c.engine_kwargs, threads=c.threads,
                owner_ttl_s=c.owner_ttl_s, use_device=devices > 0)
        starts = [self._bounded(h.start.remote(), c.start_timeout_s) for h in self.handles.values()]
        for name, report in zip(self.names, await asyncio.gather(*starts), strict=True):
            self._take_summary(name, report)
            self.reports[name] = report
        capacity = {w: r.capacity for w, r in self.reports.items()}
        self.placement = remote.placement_handle(c.namespace, self.names, capacity)
        self.assigned = await self._bounded(self.placement.place_free.remote(list(c.models)))
        loop = asyncio.get_running_loop()
        self._poller = loop.create_task(self._poll())
        self._beat = loop.create_task(self._keepalive())

    def _retryable(self, *more: type[BaseException]) -> tuple[type[BaseException], ...]:
        """What a dead, restarting or silent worker raises at a caller (and `more`)."""
        return (TimeoutError, *self.failures, *more)

    async def _bounded(self, ref: Any, timeout: float | None = None) -> Any:
        return await asyncio.wait_for(ref, timeout or self.config.call_timeout_s)

    async def _poll(self) -> None:
        """Reports and keepalives every `report_interval_s`; demand to placement."""
        while True:
            await asyncio.sleep(self.config.report_interval_s)
            try:
                await self.refresh()
            except Exception:  # any failure, logged: the next round tries again
                logger.warning("pool: report round failed", exc_info=True)

    async def refresh(self) -> None:
        async def one(name: str) -> None:
            h = self.handles[name]
            try:
                have = self._prefix_versions.get(name, -1)
                report = await self._bounded(h.report.remote(have), self.config.report_interval_s * 4)
            except self._retryable():
                self.down.add(name)
                return
            old = self.reports.get(name)
            if old is not None and old.pid != report.pid:      # restarted: its cache is empty
                self.router.forget_worker(name)
                self._prefix_versions.pop(name, None)
                self.restarts[name] += 1
                logger.warning("pool: worker %s restarted (pid %d -> %d)", name, old.pid, report.pid)
            if not report.started:          # Ray restarted the actor: its engine starts again,
                self.down.add(name)          # in the background (a model may take minutes)
                self.reports[name] = report  # (its new pid: the restart counted once)
                if name not in self._restarting:
                    self._restarting[name] = asyncio.get_running_loop().create_task(self._restart(name))
                return
            self._take_summary(name, report)
            if name in self.down:            # back after missing calls: what it may lack first
                await self._restore(name)
            self.reports[name] = report
            self.down.discard(name)

        await asyncio.gather(*(one(n) for n in self.names))
        if self.placement is None:      # (a bench or test holding the assignment fixed)
            return
        snap = await self._bounded(self.placement.rebalance.remote(self.demand()),
                                   self.config.report_interval_s * 4)
        self.assigned, self.decisions = snap["assigned"], snap["decisions"]

    async def _restore(self, name: str) -> None:
        """Give a worker that restarted (or was unreachable) the pool-wide state it may lack:
        the adapters registered through this replica and the tenants' weights. Each call
        bounded; a failure is logged and the worker still serves its base models."""
        h = self.handles[name]
        for req in list(self.adapters.values()):
            try:
                await self._bounded(h.add_lora.remote(req))
            except Exception:  # logged; its requests for it fail at acceptance
                logger.warning("pool: adapter %s not restored on %s", req.lora_name, name, exc_info=True)
        for tenant, weight in list(self.tenant_weights.items()):
            try:
                h.set_tenant_weight.remote(tenant, weight)
            except Exception:  # gone again: the next restore sends it
                logger.debug("pool: weight of %s not sent to %s", tenant, name, exc_info=True)

    def _take_summary(self, name: str, report: WorkerReport) -> None:
        """The worker's prefix summary to the router, when the report carries it (it changed
        since the version this replica holds)."""
        if report.prefixes is not None:
            self.router.set_summary(name, unpack_summary(report.prefixes))
            self._prefix_versions[name] = report.prefix_version

    async def _restart(self, name: str) -> None:
        try:
            report = await self._bounded(self.handles[name].start.remote(), self.config.start_timeout_s)
            self._take_summary(name, report)
            await self._restore(name)
            self.reports[name] = report
            self.down.discard(name)
        except Exception:
            logger.warning("pool: worker %s did not start again", name, exc_info=True)
        finally:
            self._restarting.pop(name, None)

    async def _keepalive(self) -> None:
        """Tell every worker this replica is alive, on its own beat, never waiting on a
        report, a restart or placement (a worker aborts a silent owner's requests)."""
        beat = min(self.config.report_interval_s, self.config.owner_ttl_s / 4)
        while True:
            for h in self.handles.values():
                try:
                    h.keepalive.remote(self.owner)
                except Exception:
                    logger.debug("pool: keepalive not sent", exc_info=True)
            await asyncio.sleep(beat)

    def demand(self) -> dict[str, int]:
        """Requests waiting or running per model, pool-wide (last reports)."""
        out: Counter[str] = Counter()
        for r in self.reports.values():
            if r.stats.pool is not None:
                for m, s in r.stats.pool.models.items():
                    out[m] += s.waiting + s.running
            else:
                for m in r.models:
                    out[m] += sum(r.waiting.values()) + sum(r.running.values())
        return dict(out)

    def candidates(self, model: str, exclude: str | None = None) -> list[str]:
        live = [w for w in self.names if w not in self.down and w != exclude]
        placed = [w for w in self.assigned.get(model, []) if w in live]
        if not placed and self.placement is not None:
            # not placed yet: any live worker serves it now; placement decides for the next
            self.placement.workers_for.remote(model, self.demand())
        return placed or live

    def load(self, worker: str) -> int:
        r = self.reports.get(worker)
        return (r.load("online") if r is not None else 0) + self.inflight[worker]

    def route(self, model: str, tenant: str, cache_salt: str | None, ids: list[int] | None,
              exclude: str | None = None) -> str:
        return self.route_chain(model, tenant, cache_salt, ids, exclude)[0]

    def route_chain(self, model: str, tenant: str, cache_salt: str | None, ids: list[int] | None,
                    exclude: str | None = None) -> tuple[str, list[bytes]]:
        """The worker for a request, and its prompt's prefix chain (which the worker adds to
        the summary it reports, for every replica's router)."""
        cands = self.candidates(model, exclude)
        if not cands:
            raise EngineDead("no pool worker is reachable")
        chain = prefix_chain(f"{model}\0{tenant}\0{cache_salt or ''}", ids or [])
        worker, _ = self.router.choose(cands, self.load, chain)
        return worker, chain

    def snapshot(self) -> dict:
        """For `/admin/v1/engine`: each worker's report and the placement."""
        return {"workers": {n: {"down": n in self.down, "restarts": self.restarts[n], **_report_dict(r)}
                            for n, r in self.reports.items()},
                "assigned": self.assigned, "decisions": self.decisions}

    async def close(self) -> None:
        """Stop this replica's side; the workers stay for the other replicas."""
        for task in (self._poller, self._beat, *self._restarting.values()):
            if task is not None:
                task.cancel()
        self._poller = self._beat = None

    async def destroy(self) -> None:
        """Stop this replica's side and kill the pool's actors (the last replica, a test)."""
        import ray

        await self.close()
        for h in [*self.handles.values(), self.placement]:
            if h is not None:
                ray.kill(h, no_restart=True)


def _report_dict(r: WorkerReport) -> dict:
    return {"node": r.node, "pid": r.pid, "models": r.models, "loras": r.loras,
            "waiting": r.waiting, "running": r.running, "kv_used": r.kv_used,
            "kv_total": r.kv_total, "owned": r.owned, "capacity": r.capacity, "at": r.at}


class RemoteStream(RequestStream):
    """A request's outputs read from its worker by a pump task; `accepted()` waits for the
    worker to take it (raising what `submit` would have raised)."""

    def __init__(self, pool: Pool, model: str, worker: str, prompt: Prompt,
                 params: SamplingParams, request_id: str, kwargs: dict[str, Any],
                 prefix: list[bytes] | None = None) -> None:
        self.pool = pool
        self.worker = worker
        self._prefix = prefix or []
        queue: asyncio.Queue = asyncio.Queue()
        super().__init__(request_id, queue, abort=self._abort_remote, forget=self._forget_remote)
        loop = asyncio.get_running_loop()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._model = model
        self._forgotten = False
        pool.inflight[worker] += 1
        self._task = loop.create_task(self._pump(prompt, params, kwargs))

    async def accepted(self) -> None:
        await asyncio.shield(self._accepted)

    def _fail(self, exc: BaseException) -> None:
        if not self._accepted.done():
            self._accepted.set_exception(exc)
        else:
            self._queue.put_nowait(exc)

    async def _pump(self, prompt: Prompt, params: SamplingParams, kwargs: dict[str, Any]) -> None:
        """Read the request's outputs; whatever goes wrong ends the stream with an error (its
        acceptance, if still awaited, fails), never silently."""
        try:
            await self._attempts(prompt, params, kwargs)
        except asyncio.CancelledError:
            if not self._accepted.done():
                self._accepted.set_exception(EngineDead(f"request {self.request_id} was aborted"))
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: the request ends with EngineDead
            logger.warning("pool: request %s on %s failed: %r", self.request_id, self.worker, exc)
            self._fail(EngineDead(f"pool worker {self.worker}: {type(exc).__name__}: {exc}"))

    async def _attempts(self, prompt: Prompt, params: SamplingParams, kwargs: dict[str, Any]) -> None:
        pool = self.pool
        for attempt in (0, 1):
            sent = False
            handle = pool.handles[self.worker]
            try:
                gen = handle.generate.remote(pool.owner, prompt, params, self.request_id, kwargs,
                                             self._prefix)
                ref = await pool._bounded(gen.__anext__())
                kind, value = await pool._bounded(ref)
                if kind == "error" and isinstance(value, EngineDead) and attempt == 0:
                    raise _WorkerCannotServe(str(value))      # retried on another worker
                if kind == "error":
                    self._fail(value)
                    return
                if not self._accepted.done():      # (a retry was accepted before)
                    self._accepted.set_result(None)
                async for ref in gen:
                    kind, value = await ref
                    if kind == "out":
                        sent = True
                    self._queue.put_nowait(value)
                    if kind == "error" or (isinstance(value, RequestOutput) and value.finished):
                        return
                self._fail(EngineDead(f"worker {self.worker} ended the request unfinished"))
                return
            except StopAsyncIteration:
                self._fail(EngineDead(f"worker {self.worker} ended the request without an answer"))
                return
            except pool._retryable(_WorkerCannotServe) as exc:
                pool.down.add(self.worker)
                logger.warning("pool: worker %s failed on %s: %r", self.worker, self.request_id, exc)
                if attempt == 0 and not sent:
                    try:
                        other = pool.route(self._model, kwargs.get("tenant", "default"),
                                           kwargs.get("cache_salt"), _ids(prompt), exclude=self.worker)
                    except EngineDead:
                        other = None
                    if other is not None:
                        try:    # a slow, not dead, worker may hold it: abort it there
                            handle.abort.remote(self.request_id)
                        except Exception:  # noqa: BLE001 - gone: nothing runs there
                            logger.debug("pool: abort of %s not sent", self.request_id)
                        pool.inflight[self.worker] -= 1
                        pool.inflight[other] += 1
                        self.worker = other
                        continue
                self._fail(EngineDead(f"pool worker {self.worker} failed: {type(exc).__name__}"))
                return

    def _abort_remote(self, request_id: str) -> None:
        self._task.cancel()
        try:
            self.pool.handles[self.worker].abort.remote(request_id)
        except Exception:  # the worker is gone: nothing runs there
            logger.debug("pool: abort of %s not sent", request_id, exc_info=True)

    def _forget_remote(self, request_id: str) -> None:
        # called when the stream finishes and again when it is closed: counted down once
        if not self._forgotten:
            self._forgotten = True
            self.pool.inflight[self.worker] -= 1


class _WorkerCannotServe(Exception):
    """The worker answered that it cannot serve (not started yet, or its engine stopped)."""


def _ids(prompt: Prompt) -> list[int] | None:
    if isinstance(prompt, list):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
        return prompt["prompt_token_ids"]
    return None


class PoolEngine:
    """One model of the pool as a `ServedEngine` (engine/client.py)."""

    def __init__(self, pool: Pool, model: str) -> None:
        self.pool = pool
        self.model = model
        self._loras: dict[str, LoRARequest] = {}
        self._weights: dict[str, float] = {}

    # -- EngineClient -----------------------------------------------------------------------------
    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str, *,
               tenant: str = "default", service_class: str = "online", priority: int = 0,
               model: str | None = None, cache_salt: str | None = None,
               sheddable: bool = True) -> RequestStream:
        name = model or self.model
        base = self._loras[name].base_model_name if name in self._loras else name
        worker, chain = self.pool.route_chain(base or self.model, tenant, cache_salt, _ids(prompt))
        kwargs = {"tenant": tenant, "service_class": service_class, "priority": priority,
                  "model": name, "cache_salt": cache_salt, "sheddable": sheddable}
        return RemoteStream(self.pool, base or self.model, worker, prompt, sampling_params,
                            request_id, kwargs, chain)

    async def abort(self, request_id: str) -> None:
        for h in self.pool.handles.values():
            h.abort.remote(request_id)

    def stats(self) -> EngineStats:
        parts = []
        for r in self.pool.reports.values():
            s = r.stats
            parts.append(s.by_model.get(self.model, s) if s.pool is not None else s)
        return _summed(parts)

    @property
    def is_ready(self) -> bool:
        return self.pool._started and len(self.pool.down) < len(self.pool.names)

    # -- EngineAdmin ------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.pool.start()

    async def shutdown(self) -> None:
        await self.pool.close()

    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        import dataclasses

        req = dataclasses.replace(lora_request, base_model_name=self.model)
        handles = [self.pool.handles[w] for w in self.pool.names if w not in self.pool.down]
        adapters = await asyncio.gather(*(self.pool._bounded(h.add_lora.remote(req)) for h in handles))
        self._loras[req.lora_name] = req
        self.pool.adapters[req.lora_name] = req
        return adapters[0]

    def remove_lora(self, name: str) -> bool:
        found = self._loras.pop(name, None) is not None
        self.pool.adapters.pop(name, None)
        for h in self.pool.handles.values():
            h.remove_lora.remote(name)
        return found

    def unload_lora(self, name: str) -> bool:
        for h in self.pool.handles.values():
            h.unload_lora.remote(name)
        return name in self._loras

    @property
    def loras(self) -> dict[str, LoRARequest]:
        return dict(self._loras)

    @property
    def tenant_weights(self) -> dict[str, float]:
        return dict(self._weights)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self._weights[tenant] = float(weight)
        self.pool.tenant_weights[tenant] = float(weight)
        for h in self.pool.handles.values():
            h.set_tenant_weight.remote(tenant, float(weight))


def _summed(parts: list[EngineStats]) -> EngineStats:
    """The workers' stats of one model added up; the bounded queue is each worker's own,
    the first one's shown."""
    out = summed_stats(parts)
    if parts:
        out.overload = parts[0].overload
    return out
