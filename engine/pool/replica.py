"""The gateway replica's side of the pool: `Pool`, the workers, their reports, routing and
placement, and a `ModelEngine` (engine/client.py) whose requests run on the workers; each
model is served through a `ModelBinding` (`pool.for_model(name)`).

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
from typing import Any, Unpack

from lockgate.engine.binding import ModelBinding
from lockgate.engine.client import Prompt, RequestStream, SubmitOptions
from lockgate.engine.errors import EngineDead
from lockgate.engine.lora_files import Adapter, LoRARequest
from lockgate.engine.pool.kv_index import KVIndex, engine_chain, engine_salt
from lockgate.engine.pool.placement import pool_workers
from lockgate.engine.pool.router import BLOCK, Price, Router, price_of, priced_alike, request_chain, unpack_summary
from lockgate.engine.pool.stream import RemoteStream, prompt_ids
from lockgate.engine.pool.worker import WorkerReport
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.stats import EngineStats, WorkerPoolStats, summed_stats

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
    """The workers as this replica sees them; one per process, shared by its models' bindings."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.owner = f"gw-{secrets.token_hex(6)}"
        # a routed prefix counts as held until its worker's events could show it
        self.router = Router(recent_s=max(1.0, 4 * config.report_interval_s))
        # what each worker's cache holds, from its KV events (stale after 8 silent rounds)
        self.kv_index = KVIndex(max_age_s=max(2.0, 8 * config.report_interval_s))
        self.names: list[str] = []
        self.handles: dict[str, Any] = {}
        self.reports: dict[str, WorkerReport] = {}
        self.down: set[str] = set()
        self.assigned: dict[str, list[str]] = {}
        self.inflight: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()              # prompt tokens routed, not yet computed
        self.others: Counter[str] = Counter()               # other replicas' requests on each worker
        self.restarts: Counter[str] = Counter()            # worker restarts this replica saw
        self.decisions: list[dict] = []                      # placement's recent, with reasons
        self.placement: Any = None
        self.failures: tuple[type[BaseException], ...] = ()
        self._poller: asyncio.Task[None] | None = None
        self._beat: asyncio.Task[None] | None = None
        self._restarting: dict[str, asyncio.Task[None]] = {}
        self.last_prefill = 0                                # the last routed prompt's tokens to compute
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
        tp = max(1, int(c.engine_kwargs.get("tensor_parallel_size", 1)))
        await asyncio.to_thread(remote.connect, c.address, c.namespace, min_devices=tp)
        self.failures = remote.actor_failures()
        nodes = await self._bounded(asyncio.to_thread(remote.node_devices))
        devices = sum(nodes)
        self.names = [f"lockgate-worker-{i}" for i in range(pool_workers(nodes, tp, c.workers))]
        for name in self.names:
            self.handles[name] = remote.worker_handle(
                name, c.namespace, name, c.models, c.engine_kwargs, threads=c.threads,
                owner_ttl_s=c.owner_ttl_s, devices=tp if devices > 0 else 0)
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
                report = await self._bounded(h.report.remote(have, *self.kv_index.cursor(name)),
                                             self.config.report_interval_s * 4)
            except self._retryable():
                self.down.add(name)
                return
            old = self.reports.get(name)
            if old is not None and old.pid != report.pid:      # restarted: its cache is empty
                self.router.forget_worker(name)
                self.kv_index.forget(name)
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
            self.others[name] = report.owned - report.by_owner.get(self.owner, 0)
            if report.kv_events is not None:
                self.kv_index.apply(name, report.kv_events)
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
        # this replica's own requests counted now; other replicas' as of the worker's last report
        return self.inflight[worker] + self.others[worker]

    def route(self, model: str, tenant: str, cache_salt: str | None, ids: list[int] | None,
              exclude: str | None = None) -> str:
        return self.route_chain(model, tenant, cache_salt, ids, exclude)[0]

    def route_chain(self, model: str, tenant: str, cache_salt: str | None, ids: list[int] | None,
                    exclude: str | None = None, hint: str | None = None, *,
                    share_group: str | None = None, adapter: bool = False,
                    service_class: str = "online") -> tuple[str, list[bytes]]:
        """The worker for a request, and its prompt's prefix chain (which the worker adds to
        the summary it reports, for every replica's router), led by its cache hint's key when
        it has one: the shortest "prefix", so any longer cached prefix still wins. Where a
        worker's KV events are fresh, the router reads what it caches from the index (not for
        an `adapter`'s request: its blocks are salted by the adapter's id on that worker)."""
        cands = self.candidates(model, exclude)
        if not cands:
            raise EngineDead("no pool worker is reachable")
        ids = ids or []
        chain = request_chain(model, tenant, cache_salt, ids, hint)
        salt = engine_salt(model, tenant, cache_salt, share_group)
        chains: dict[int, list[bytes]] = {}

        def cached(w: str) -> int | None:
            if adapter or not ids or not self.kv_index.fresh(w):
                return None
            bs = self.reports[w].block_size if w in self.reports else 16
            if bs not in chains:
                chains[bs] = engine_chain(salt, ids, bs)
            return self.kv_index.match(w, chains[bs]) * bs

        worker, held = self.router.choose(cands, self.load, chain, cached=cached,
                                          prices=self.prices(model, cands, len(ids)),
                                          inflight=self.inflight.__getitem__, pending=self.pending.__getitem__,
                                          service_class=service_class, prompt_tokens=len(ids))
        self.last_prefill = max(0, len(ids) - held * BLOCK)
        return worker, chain

    def prices(self, model: str, workers: list[str], prompt_tokens: int) -> dict[str, Price]:
        """Each worker's price of a prompt, from its fitted cost model for `model` (an unfitted
        one priced as the others)."""
        out: dict[str, Price | None] = {}
        for w in workers:
            r = self.reports.get(w)
            s = r.stats.by_model.get(model, r.stats) if r is not None else None
            fit = s.cost_model if s is not None else None
            out[w] = price_of(fit.coefficients if fit is not None and fit.ready else None, prompt_tokens)
        return priced_alike(out)

    def snapshot(self) -> WorkerPoolStats:
        """Each worker's report and the placement, in every model's stats (`workers`)."""
        return WorkerPoolStats(
            workers={n: {"down": n in self.down, "restarts": self.restarts[n], **_report_dict(r),
                         "kv_index": self._index_dict(n)}
                     for n, r in self.reports.items()},
            assigned=dict(self.assigned), decisions=list(self.decisions))

    def _index_dict(self, worker: str) -> dict:
        """What the router's KV index holds of `worker`: blocks per tier, and how fresh."""
        e = self.kv_index.workers.get(worker)
        return {"blocks": {t: len(h) for t, h in e.held.items()} if e is not None else {},
                "fresh": self.kv_index.fresh(worker), "staleness_s": self.kv_index.staleness_s(worker),
                "gaps": e.gaps if e is not None else 0, "snapshots": e.snapshots if e is not None else 0}

    # -- a ModelEngine of the pool's models -------------------------------------------------------
    def for_model(self, name: str) -> ModelBinding:
        return ModelBinding(self, name)

    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
               **options: Unpack[SubmitOptions]) -> RequestStream:
        name = options.get("model") or next(iter(self.config.models))
        base = self.adapters[name].base_model_name if name in self.adapters else name
        base = base or next(iter(self.config.models))
        worker, chain = self.route_chain(base, options.get("tenant", "default"), options.get("cache_salt"),
                                         prompt_ids(prompt), hint=options.get("cache_hint"),
                                         adapter=name != base,
                                         service_class=options.get("service_class", "online"))
        kwargs = {"tenant": "default", "service_class": "online", "priority": 0, "cache_salt": None,
                  "sheddable": True, **options, "model": name}
        return RemoteStream(self, base, worker, prompt, sampling_params, request_id, kwargs, chain,
                            prefill=self.last_prefill)

    async def abort(self, request_id: str) -> None:
        for h in self.handles.values():
            h.abort.remote(request_id)

    def stats(self) -> EngineStats:
        return _summed({w: r.stats for w, r in self.reports.items()}, self.snapshot())

    def model_stats(self, model: str) -> EngineStats:
        parts = {w: r.stats.by_model.get(model, r.stats) if r.stats.pool is not None else r.stats
                 for w, r in self.reports.items()}
        return _summed(parts, self.snapshot())

    @property
    def is_ready(self) -> bool:
        return self._started and len(self.down) < len(self.names)

    async def shutdown(self) -> None:
        await self.close()

    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        handles = [self.handles[w] for w in self.names if w not in self.down]
        adapters = await asyncio.gather(*(self._bounded(h.add_lora.remote(lora_request)) for h in handles))
        self.adapters[lora_request.lora_name] = lora_request
        return adapters[0]

    def remove_lora(self, name: str) -> bool:
        found = self.adapters.pop(name, None) is not None
        for h in self.handles.values():
            h.remove_lora.remote(name)
        return found

    def unload_lora(self, name: str) -> bool:
        for h in self.handles.values():
            h.unload_lora.remote(name)
        return name in self.adapters

    @property
    def loras(self) -> dict[str, LoRARequest]:
        return dict(self.adapters)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.tenant_weights[tenant] = float(weight)
        for h in self.handles.values():
            h.set_tenant_weight.remote(tenant, float(weight))

    def purge_tenant(self, tenant: str) -> None:
        for h in self.handles.values():   # fire and forget: a worker that misses it keeps blocks no one hits
            h.purge_tenant.remote(tenant)


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
            "kv_total": r.kv_total, "owned": r.owned, "capacity": r.capacity, "at": r.at,
            "tensor_parallel_size": r.tensor_parallel_size, "devices": r.devices,
            "prefix_cache_queries": r.stats.kv.prefix_cache_queries,
            "prefix_cache_hits": r.stats.kv.prefix_cache_hits,     # either tier's, as the engine's
            "kv_host": {"queries": r.stats.kv.host_queries, "hits": r.stats.kv.host_hits,
                        "held": r.stats.kv.host_held, "copy_ins": r.stats.kv.host_copy_ins}}


def _summed(parts: dict[str, EngineStats], workers: WorkerPoolStats) -> EngineStats:
    """The workers' stats (of one model) added up, each worker's own kept in `by_worker`,
    with the pool's workers and placement; the bounded queue is each worker's own, the first
    one's shown."""
    out = summed_stats(parts.values())
    if parts:
        out.overload = next(iter(parts.values())).overload
    out.workers = workers
    out.by_worker = dict(parts)
    return out
