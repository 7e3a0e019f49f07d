"""Several base models (full precision or quantized, each with its adapters) on one device
memory budget: `ModelPool`.

Each model is an `EngineCore` of its own (weights, KV cache, scheduler, queue); the pool
owns the budget and decides, step by step, which model runs:

- one model per step;
- the most urgent class first: a model with online work waiting goes before one with only
  offline work, at once (that is what online means);
- among models with work of that class, the current one keeps the device for a *turn*
  long enough that switching into it cost at most `switch_overhead` of the turn (the
  measured cost of the last switch, over `switch_overhead`); then it *drains*: it starts
  nothing new and finishes what runs (for at most `max_drain_s` or another turn's length,
  whichever is longer, after which what still runs is preempted), so a switch throws away
  no computed KV; then the model that has
  waited longest since its last turn goes next (round robin, so no model starves);
- bringing a model in reserves its whole footprint (weights + LoRA slots + KV cache) before
  loading it, offloading the least recently run resident models until it fits, so the
  budget is never exceeded. An offloaded model's running requests are preempted back to its
  queue first (they keep their place and are recomputed); none is lost or failed.

Offloading drops the weights (read again from the checkpoint's memory-mapped safetensors on
return) and frees the KV cache and LoRA slots; adapters stay in host memory.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from lockgate.engine.config import EngineConfig, ModelConfig
from lockgate.engine.engine_core import EngineCore
from lockgate.engine.errors import InvalidRequest, UnknownModel
from lockgate.engine.lora import Adapter, LoRAManager, LoRARequest
from lockgate.engine.memory import CUDA_ACTIVATION_HEADROOM, MemoryBudget
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.request import EngineRequest, RequestState
from lockgate.engine.spec.config import SpeculativeConfig
from lockgate.engine.stats import EngineStats, PooledModelStats, PoolStats, summed_parallel, summed_stats
from lockgate.engine.step_engine import StepEngine
from lockgate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def make_core(config: EngineConfig, *, stream_outputs: bool = False) -> StepEngine:
    """One EngineCore for one model; a ModelPool when `config.models` names more."""
    if config.models:
        return ModelPool(config, stream_outputs=stream_outputs)
    return EngineCore(config, stream_outputs=stream_outputs)


@dataclasses.dataclass(slots=True)
class SwitchCounters:
    """One model's loads, offloads and turns in the pool."""

    loads: int = 0
    offloads: int = 0
    load_s: float = 0.0
    offload_s: float = 0.0
    turns: int = 0
    steps: int = 0
    last_run: float = 0.0


class ModelPool:
    """Several `EngineCore`s behind the one `StepEngine` interface an `EngineCore` has."""

    def __init__(self, config: EngineConfig, *, stream_outputs: bool = False) -> None:
        self.config = config
        first = config.served_model_name or Path(config.model).name
        specs = {first: config.model, **config.models}
        if len(specs) != 1 + len(config.models):
            raise ValueError(f"models: the name {first!r} is given twice")
        # a draft model is the first model's (speculative_config is written beside `model`);
        # the n-gram method needs no model and goes with every one
        spec = config.speculative_config
        other_spec = None if isinstance(spec, SpeculativeConfig) and spec.draft_model else spec
        self.cores: dict[str, EngineCore] = {
            name: EngineCore(dataclasses.replace(config, model=str(path), models={}, served_model_name=name,
                                                 speculative_config=spec if name == first else other_spec),
                             stream_outputs=stream_outputs, pooled=True, name=name)
            for name, path in specs.items()
        }
        self.default = next(iter(self.cores))
        self.device = self.cores[self.default].device
        footprints = {n: sum(c.footprint().values()) for n, c in self.cores.items()}
        if config.memory_budget is not None:
            total = config.memory_budget
        elif self.device.type == "cuda":
            _, dev_total = torch.cuda.mem_get_info(self.device)
            total = int(dev_total * config.gpu_memory_utilization) - CUDA_ACTIVATION_HEADROOM
        else:
            total = sum(footprints.values())    # CPU, no budget given: every model fits
        self.memory = MemoryBudget(total, str(self.device))
        for name, need in footprints.items():
            if need > total:
                raise ValueError(
                    f"models: {name!r} needs {need / 2**20:.1f} MiB (weights, LoRA slots, KV cache), "
                    f"more than the whole budget of {total / 2**20:.1f} MiB"
                )
        self.peak_used_bytes = 0
        self.stats_by_model = {n: SwitchCounters() for n in self.cores}
        self.current: str | None = None
        self.turn_started = 0.0
        self.last_switch_s = 0.0
        self.switch_s_total = 0.0
        self.num_switches = 0
        self.owner: dict[str, str] = {}          # request id -> model name
        self.failed: list[tuple[str, Exception]] = []
        for name in self.cores:                  # in order, while they fit
            if footprints[name] <= self.memory.available_bytes:
                self._bring_in(name, count=False)

    # -- what LLM and AsyncEngine use ---------------------------------------------------------
    def core_for(self, model: str | None) -> EngineCore:
        if model is None:
            return self.cores[self.default]
        for core in self.cores.values():
            if model in core.served_model_names:
                return core
        raise UnknownModel(f"model: {model!r} is not served by this engine")

    @property
    def tokenizer(self) -> Tokenizer:
        return self.cores[self.default].tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.cores[self.default].model_config

    @property
    def max_model_len(self) -> int:
        return self.cores[self.default].max_model_len

    @property
    def served_model_names(self) -> set[str]:
        return set().union(*(c.served_model_names for c in self.cores.values()))

    @property
    def lora(self) -> LoRAManager | None:
        return self.cores[self.default].lora

    @property
    def requests(self) -> dict[str, RequestState]:
        out: dict[str, RequestState] = {}
        for core in self.cores.values():
            out.update(core.requests)
        return out

    @property
    def has_unfinished(self) -> bool:
        return any(c.has_unfinished for c in self.cores.values())

    def validate(self, req: EngineRequest) -> None:
        self.core_for(req.model).validate(req)
        if req.request_id in self.owner:
            raise InvalidRequest(f"request_id: {req.request_id!r} is already in the engine",
                                 field="request_id")

    def add_request(self, req: EngineRequest) -> RequestState:
        self.validate(req)
        core = self.core_for(req.model)
        state = core.add_request(req)
        self.owner[req.request_id] = core.name
        return state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        name = self.owner.pop(request_id, None)
        return None if name is None else self.cores[name].abort_request(request_id)

    def add_lora(self, lora_request: LoRARequest) -> Adapter:
        # a request that is no LoRARequest goes to the default model, which refuses it by name
        return self.core_for(getattr(lora_request, "base_model_name", None)).add_lora(lora_request)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        for core in self.cores.values():
            core.set_tenant_weight(tenant, weight)

    def purge_tenant(self, tenant: str) -> None:
        for core in self.cores.values():
            core.purge_tenant(tenant)

    def shutdown(self) -> None:
        for core in self.cores.values():
            core.shutdown()

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        name = self.choose()
        if name is None:
            return []
        core = self.cores[name]
        if not core.resident:
            self._bring_in(name)
        now = time.perf_counter()
        if name != self.current:
            self.current, self.turn_started = name, now
            self.stats_by_model[name].turns += 1
        st = self.stats_by_model[name]
        st.steps += 1
        outputs = core.step()
        st.last_run = time.perf_counter()
        for out in outputs:
            if out.finished:
                self.owner.pop(out.request_id, None)
        while core.failed:
            rid, exc = core.failed.pop()
            self.owner.pop(rid, None)
            self.failed.append((rid, exc))
        return outputs

    @staticmethod
    def urgency(core: EngineCore) -> int | None:
        """The most urgent class rank among the model's queued and running sequences."""
        sched = core.scheduler
        ranks = [s.state.class_rank for s in sched.running] + [s.state.class_rank for s in sched.waiting]
        return min(ranks) if ranks else None

    def quantum_s(self) -> float:
        """How long a model keeps the device once it has it (while others wait in its class):
        long enough that the last switch cost at most `switch_overhead` of the turn."""
        f = self.config.switch_overhead
        return max(self.config.min_turn_s, self.last_switch_s * (1 - f) / f)

    def choose(self) -> str | None:
        urg = {n: u for n, c in self.cores.items() if (u := self.urgency(c)) is not None}
        if not urg:
            return None
        top = min(urg.values())
        cands = [n for n, u in urg.items() if u == top]
        cur = self.current
        if cur in cands:
            elapsed, quantum = time.perf_counter() - self.turn_started, self.quantum_s()
            if len(cands) == 1 or elapsed < quantum:
                self.cores[cur].scheduler.admission_paused = False
                return cur
            sched = self.cores[cur].scheduler
            if sched.running and elapsed < quantum + max(quantum, self.config.max_drain_s):
                sched.admission_paused = True      # drain: finish what runs, start nothing
                return cur
            cands = [n for n in cands if n != cur]
        if cur is not None:
            self.cores[cur].scheduler.admission_paused = False
        return min(cands, key=lambda n: (self.stats_by_model[n].last_run, n))

    # -- residency ------------------------------------------------------------------------------
    def _bring_in(self, name: str, count: bool = True) -> None:
        core = self.cores[name]
        parts = core.footprint()
        need = sum(parts.values())
        t0 = time.perf_counter()
        victims = sorted((n for n, c in self.cores.items() if c.resident and n != name),
                         key=lambda n: self.stats_by_model[n].last_run)
        while self.memory.available_bytes < need and victims:
            self._offload(victims.pop(0))
        for part, num in parts.items():    # reserve first: never over budget, not even briefly
            self.memory.reserve(f"{name}/{part}", num)
        self.peak_used_bytes = max(self.peak_used_bytes, self.memory.used_bytes)
        t1 = time.perf_counter()
        core.load()
        t2 = time.perf_counter()
        st = self.stats_by_model[name]
        st.loads += 1
        st.load_s += t2 - t1
        if count:
            self.num_switches += 1
            self.last_switch_s = t2 - t0
            self.switch_s_total += t2 - t0
        logger.info("model %s loaded in %.3f s (switch %.3f s)", name, t2 - t1, t2 - t0)

    def _offload(self, name: str) -> None:
        core = self.cores[name]
        t0 = time.perf_counter()
        core.offload()
        for part in core.footprint():
            self.memory.release(f"{name}/{part}")
        st = self.stats_by_model[name]
        st.offloads += 1
        st.offload_s += time.perf_counter() - t0
        logger.info("model %s offloaded", name)

    # -- introspection --------------------------------------------------------------------------
    def verify(self, sched=None) -> None:
        for core in self.cores.values():
            core.verify()
        if self.memory.used_bytes > self.memory.total_bytes:
            raise AssertionError("memory budget exceeded")

    def stats(self) -> EngineStats:
        """The totals over the models, the pool (memory, switches, each model's residency)
        and each model's own stats in `by_model`."""
        per = {n: c.stats() for n, c in self.cores.items()}
        out = summed_stats(per.values())
        out.memory = {**self.memory.summary(), "used_bytes": self.memory.used_bytes,
                      "peak_used_bytes": self.peak_used_bytes}
        models = {
            n: PooledModelStats(
                resident=self.cores[n].resident,
                memory_bytes=sum(self.cores[n].footprint().values()),
                waiting=sum(per[n].waiting_requests.values()),
                running=sum(per[n].running.values()),
                **dataclasses.asdict(self.stats_by_model[n]),
                lora=per[n].lora,
            )
            for n in self.cores
        }
        out.pool = PoolStats(out.memory, self.num_switches, self.switch_s_total, self.current, models)
        out.parallel = summed_parallel(s.parallel for s in per.values())
        out.by_model = per
        return out
