"""`AsyncEngine`: the serving face. The step loop runs in a thread of its own; `generate`
streams cumulative outputs to the caller's event loop as tokens arrive.

    async with AsyncEngine(model=DIR) as engine:
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8), "req-1"):
            print(out.outputs[0].delta_text, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from lockgate.engine.admission import Admission, Queued
from lockgate.engine.binding import ModelBinding
from lockgate.engine.client import EngineAdmin, EngineClient, Prompt, RequestStream, checked_tenant_weight
from lockgate.engine.config import EngineConfig, ModelConfig
from lockgate.engine.cost_model import StepShape
from lockgate.engine.engine_core import EngineCore
from lockgate.engine.errors import EngineDead, EngineOverloaded, InvalidRequest, LoRAError, RankFailure
from lockgate.engine.llm import to_token_ids
from lockgate.engine.lora import Adapter, LoRARequest
from lockgate.engine.model_pool import ModelPool, make_core
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.request import EngineRequest
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.stats import EngineStats
from lockgate.engine.step_engine import StepEngine
from lockgate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class AsyncEngine(EngineClient, EngineAdmin):
    """The in-process engine: an `EngineClient` and `EngineAdmin` (engine/client.py)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig(model=str(model), **kwargs)
        self.core: StepEngine | None = None
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        c = self.config
        self._admission = Admission(c.service_classes, max_waiting_per_class=c.max_waiting_per_class,
                                    max_waiting_tokens=c.max_waiting_tokens)
        self._stats = EngineStats()
        self._error: BaseException | None = None
        self._tenant_weights: dict[str, float] = {}
        self._variants: dict[str, LoRARequest] = {}   # adapter name -> its request
        self._steps_since_sizing = 0

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.core is None:
            self.core = await asyncio.to_thread(make_core, self.config, stream_outputs=True)
            for tenant, weight in self._tenant_weights.items():
                self.core.set_tenant_weight(tenant, weight)
            self._stats = self.core.stats()
            self._size_queue(self.core)
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="lockgate-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        with self._lock:
            self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        with self._lock:
            streams = list(self._streams)
        for rid in streams:
            self._deliver(rid, EngineDead("engine shut down"))
        # requests the loop never finished: free their blocks
        if self.core is not None:
            for rid in list(self.core.requests):
                self.core.abort_request(rid)
            self.core.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.shutdown()

    @property
    def is_ready(self) -> bool:
        return self.core is not None

    # -- the default model, for callers in this process ---------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self._core.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self._core.model_config

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def tenant_weights(self) -> dict[str, float]:
        return dict(self._tenant_weights)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        """A tenant's share in the scheduler's fairness (1.0 when never set). Kept here and
        read by the scheduler's fairness counters."""
        weight = self._tenant_weights[tenant] = checked_tenant_weight(tenant, weight)
        if self.core is not None:   # a dict store: atomic under the GIL, read by the loop thread
            self.core.set_tenant_weight(tenant, weight)

    def purge_tenant(self, tenant: str) -> None:
        """A deleted tenant's cached KV blocks dropped from both tiers of every model (before
        the step loop's next prefix lookup: a list append, safe from this thread)."""
        if self.core is not None:
            self.core.purge_tenant(tenant)

    # -- adapters ---------------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        """Read and check an adapter (on a worker thread: the running batch goes on) and
        serve it under its name: `submit(..., model=lora_request.lora_name)`. Returns the
        checked adapter (its rank and targets as its tensors have them). Raises LoRAError
        naming the problem; nothing is registered then."""
        core = self._core
        name = lora_request.lora_name
        known = self._variants.get(name)
        if known is not None and known != lora_request:
            raise LoRAError(f"lora_name: {name!r} is already registered as adapter {known.lora_int_id}",
                            field="lora_name")
        if name in core.served_model_names:
            raise LoRAError(f"lora_name: {name!r} is the base model's name", field="lora_name")
        adapter = await asyncio.to_thread(core.add_lora, lora_request)
        self._variants[name] = lora_request
        return adapter

    def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter and free its memory; refused (AdapterInUse) while requests
        use it."""
        if not self.unload_lora(name):
            return False
        del self._variants[name]
        return True

    def unload_lora(self, name: str) -> bool:
        """Drop an adapter's weights from memory but keep serving it: the next request
        reads it again. False if it is not registered."""
        req = self._variants.get(name)
        if req is None:
            return False
        lora = self.core_for_model(req.base_model_name).lora
        if lora is not None:
            lora.remove(req.lora_int_id)
        return True

    def for_model(self, name: str) -> ModelBinding:
        """One of the engine's models as a `ServedEngine` of its own (see ModelBinding)."""
        self._core.core_for(name)   # UnknownModel if it is not served
        return ModelBinding(self, name)

    def core_for_model(self, name: str | None) -> EngineCore:
        """The core serving model `name` (None: the default); UnknownModel if none does."""
        return self._core.core_for(name)

    @property
    def loras(self) -> dict[str, LoRARequest]:
        return dict(self._variants)

    @property
    def _core(self) -> StepEngine:
        if self.core is None:
            raise RuntimeError("AsyncEngine is not started; call `await engine.start()` first")
        return self.core

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step (safe to read from any thread), with the
        queue's bounds, refusals and sheds in `overload`."""
        with self._lock:
            overload = self._admission.stats()
            stats = self._stats
        return dataclasses.replace(stats, overload=overload)

    def model_stats(self, model: str) -> EngineStats:
        """One model's stats, with the engine's queue (`overload`: one for every model), the
        pool of models and this model's residency in it; an engine of one model: its stats."""
        s = self.stats()
        if s.pool is None:
            return s
        own = s.by_model.get(model, EngineStats())
        return dataclasses.replace(own, overload=s.overload, pool=s.pool, residency=s.pool.models.get(model))

    # -- requests ---------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        request_id: str,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs as tokens arrive; the last one has `finished` set. Raises
        InvalidRequest for bad input and EngineOverloaded for a full queue before queueing.
        Keyword arguments as `submit`'s. Leaving the loop early aborts the request."""
        stream = self.submit(prompt, sampling_params, request_id, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def submit(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        tenant: str = "default",
        service_class: str = "online",
        priority: int = 0,
        model: str | None = None,
        cache_salt: str | None = None,
        share_group: str | None = None,
        tenant_weight: float | None = None,
        lora_request: LoRARequest | None = None,
        sheddable: bool = True,
        cache_hint: str | None = None,
    ) -> RequestStream:
        """Queue a request now (raising InvalidRequest, PromptTooLong or EngineOverloaded at once,
        before anything is queued) and return its stream of outputs. Must be called from
        the caller's event loop; `close()` the stream when done with it (it aborts the
        request if it has not finished). A `sheddable` request may later be shed to make
        room for more urgent work while it has sent nothing: its stream then raises
        EngineOverloaded(shed=True) before any output (engine/admission.py). `cache_hint` routes
        a pool's requests (engine/client.py `SubmitOptions`); this engine's one cache needs none."""
        core = self._core
        if model is not None and model in self._variants:
            if lora_request is not None and lora_request != self._variants[model]:
                raise InvalidRequest(f"model: {model!r} is an adapter; do not pass another lora_request",
                                     field="model")
            lora_request = self._variants[model]
            model = lora_request.base_model_name
        text, ids = to_token_ids(core.core_for(model).tokenizer, prompt)
        req = EngineRequest(request_id, ids, sampling_params, prompt=text, tenant=tenant,
                            service_class=service_class, priority=priority, model=model,
                            cache_salt=cache_salt, share_group=share_group,
                            tenant_weight=tenant_weight, lora_request=lora_request)
        core.validate(req)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self._error is not None:
                raise EngineDead(f"engine stopped: {self._error!r}")
            if self._thread is None or self._stop.is_set():
                raise EngineDead("engine is not running; call `await engine.start()` first")
            if request_id in self._streams:
                raise InvalidRequest(f"request_id: {request_id!r} is already in the engine",
                                     field="request_id")
            sp = sampling_params
            max_tokens = sp.max_tokens if sp.max_tokens is not None else core.max_model_len - len(ids)
            shed = self._admission.admit(Queued(
                request_id, service_class, self._admission.rank[service_class], tenant,
                len(ids) + max(0, max_tokens) * sp.n, sheddable))
            for victim in shed:
                self._inbox.append(("shed", victim))
            self._streams[request_id] = (loop, queue)
            self._inbox.append(("add", req))
        self._wake.set()
        return RequestStream(request_id, queue, abort=self._post_abort, forget=self._forget)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self._admission.forget(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks at the next turn of the loop."""
        self._post_abort(request_id)

    def _post_abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    # -- the loop thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        core = self._core
        while not self._stop.is_set():
            try:
                drained = self._drain_inbox(core)
                if not core.has_unfinished:
                    self._publish_stats(core, drained)
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = core.step()
                self._steps_since_sizing += 1
                self._publish_stats(core, drained)
                with self._lock:
                    for out in outputs:     # it sent something: no longer queued
                        self._admission.forget(out.request_id)
                self._deliver_all([(out.request_id, out) for out in outputs])
                while core.failed:   # e.g. an adapter that could not be read again
                    rid, exc = core.failed.pop()
                    self._deliver(rid, exc)
            except RankFailure as exc:
                if not self._recover(core, exc):
                    return
            except Exception as exc:   # a bug: fail every caller loudly rather than hang them
                logger.exception("engine step failed")
                with self._lock:
                    self._error = exc
                    streams = list(self._streams)
                for rid in streams:
                    self._deliver(rid, EngineDead(f"engine step failed: {exc!r}"))
                return

    def _recover(self, core: StepEngine, exc: RankFailure) -> bool:
        """A rank of the model's group failed (died, or a collective timed out): every request
        in flight or queued fails as a dead engine's would (EngineDead), the core forgets them
        and spawns a fresh rank group, and the loop goes on; False (the engine stopped, every
        later call EngineDead) when the group could not be rebuilt."""
        failed_at = time.monotonic()
        logger.error("tensor parallel rank failed; failing the requests in flight and rebuilding the rank "
                     "group: %s", exc)
        with self._lock:
            failed = list(self._streams)
            # what was queued for the old group goes with it: their callers are told below
            self._inbox = deque(item for item in self._inbox if item[0] == "abort")
        for rid in failed:
            self._deliver(rid, EngineDead(f"engine step failed: {exc}"))
        with self._lock:
            for rid in failed:
                self._streams.pop(rid, None)
                self._admission.forget(rid)
        try:
            rebuild = getattr(core, "rebuild_ranks", None)
            if rebuild is None:
                raise exc
            rebuild(failed_at)
        except Exception as err:   # the engine stops: every later call is told (EngineDead)
            logger.exception("rebuilding the tensor parallel rank group failed")
            with self._lock:
                self._error = err
            return False
        logger.warning("tensor parallel rank group rebuilt in %.2f s; serving again", time.monotonic() - failed_at)
        return True

    def _publish_stats(self, core: StepEngine, drained: int) -> None:
        stats = core.stats()
        with self._lock:
            self._stats = stats
        if drained or self._steps_since_sizing >= 64:
            self._size_queue(core)

    def _size_queue(self, core: StepEngine) -> None:
        """The queue's token bound from the KV cache and the cost model's full-step rate."""
        self._steps_since_sizing = 0
        cores = list(core.cores.values()) if isinstance(core, ModelPool) else [core.core_for(None)]
        kv_tokens = sum(c.num_kv_blocks * c.config.block_size for c in cores)
        rates = []
        for c in cores:
            n = c.config.max_num_batched_tokens
            t = c.scheduler.cost.predict(StepShape(prefill_tokens=n, num_seqs=1,
                                                   prefill_attention=n * n, sampled=1))
            if t:
                rates.append(n / t)
        with self._lock:
            self._admission.size(kv_tokens, min(rates) if rates else None)

    def _shed(self, core: StepEngine, victim: Queued) -> None:
        """Shed a queued request that has sent nothing; one that got going in the meantime
        (it was in the step that ran while the arrival was admitted) goes on."""
        rid = victim.request_id
        state = core.requests.get(rid)
        if state is not None and state.first_token_time is not None:
            return
        if state is not None:
            core.abort_request(rid)
        with self._lock:
            self._admission.count_shed(victim)
        self._deliver(rid, EngineOverloaded(
            f"service_class {victim.service_class!r}: shed from the queue to make room for more "
            "urgent work", service_class=victim.service_class,
            retry_after=self._admission.retry_after(), shed=True))

    def _drain_inbox(self, core: StepEngine) -> int:
        drained = 0
        while True:
            with self._lock:
                if not self._inbox:
                    return drained
                kind, payload = self._inbox.popleft()
            if kind == "add":
                drained += 1
                if payload.request_id not in self._streams:
                    continue    # the caller went away before the request got in
                # validated already (a race on request ids at most); whatever it raises goes to
                # that request's caller, never up into the step loop that serves the others
                try:
                    core.add_request(payload)
                except Exception as exc:  # noqa: BLE001 - delivered to the caller, who raises it
                    self._deliver(payload.request_id, exc)
            elif kind == "shed":
                self._shed(core, payload)
            else:
                final = core.abort_request(payload)
                if final is not None:   # a caller still reading gets its last output
                    self._deliver(payload, final)

    def _deliver_all(self, items: list[tuple[str, Any]]) -> None:
        """A step's outputs: one wake-up of each caller's loop for all of its streams' (a
        wake-up per output costs the loop a callback and a write to its self-pipe each)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        with self._lock:
            for request_id, item in items:
                target = self._streams.get(request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, found in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the caller's loop may be closed
                loop.call_soon_threadsafe(_put_all, found)

    def _deliver(self, request_id: str, item: Any) -> None:
        self._deliver_all([(request_id, item)])


def _put_all(found: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in found:
        queue.put_nowait(item)
