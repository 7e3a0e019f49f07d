"""The engine core: requests in, one `step()` at a time, outputs out. Single-threaded; `LLM`
drives it directly and `AsyncEngine` from a thread of its own."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from pathlib import Path

import torch

from lockgate.engine.config import DTYPES, EngineConfig, ModelConfig
from lockgate.engine.errors import InvalidRequest, PromptTooLong, UnknownModel
from lockgate.engine.grammar import GrammarManager, grammar_compiler
from lockgate.engine.kv_cache import KVCacheManager
from lockgate.engine.kv_cache.host_tier import host_tier_for, recompute_price
from lockgate.engine.lora import Adapter, LoRAManager, LoRARequest
from lockgate.engine.memory import CPU_DEFAULT_KV_BYTES, MemoryBudget
from lockgate.engine.model_runner import ModelRunner, StepTimings
from lockgate.engine.output_processor import OutputProcessor
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.parallel.executor import rank_spec
from lockgate.engine.platform import tune_cpu_allocator
from lockgate.engine.request import EngineRequest, RequestState, SeqStatus, Sequence, check_request
from lockgate.engine.scheduler import Scheduler
from lockgate.engine.spec.config import SpeculativeConfig
from lockgate.engine.spec.decode import SpecDecoder
from lockgate.engine.stats import EngineStats, QueueStats, TenantClassStats
from lockgate.engine.threads import governor_for
from lockgate.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    dtype = DTYPES.get(model_dtype.removeprefix("torch."), torch.float32)
    if device.type == "cpu" and dtype is torch.float16:
        return torch.float32  # CPUs have no fast fp16 matmul
    return dtype


class EngineCore:
    """One model: its weights, KV cache, scheduler and requests. Alone (the usual case) it
    sizes its own memory budget and loads at once. In a `ModelPool` (`pooled=True`) the pool
    owns the budget, and loads and offloads the model by demand (`load`, `offload`)."""

    def __init__(self, config: EngineConfig, *, stream_outputs: bool = False, pooled: bool = False,
                 name: str | None = None) -> None:
        self.config = config
        self.stream_outputs = stream_outputs
        self.name = name or config.served_model_name or Path(config.model).name
        self.device = config.resolve_device()
        self.threads = governor_for(config.num_threads, config.tensor_parallel_size, self.device)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.model_config = ModelConfig.from_dir(config.model)
        mc = self.model_config
        self.max_model_len = mc.context_length(config.max_model_len)
        self.dtype = resolve_dtype(config.dtype, mc.torch_dtype, self.device)
        self.tokenizer = Tokenizer(config.model)
        torch.manual_seed(config.seed)
        spec = SpeculativeConfig.of(config.speculative_config)
        self.runner = ModelRunner(config.model, mc, self.max_model_len, self.dtype, self.device, config.seed,
                                  ranks=rank_spec(config, mc, self.device, self.dtype, self.max_model_len),
                                  draft_dir=spec.draft_model if spec else None)
        bs = config.block_size
        self.memory: MemoryBudget | None = None
        self.lora, self.num_kv_blocks = self._start_runner(pooled)
        self.kv = KVCacheManager(self.num_kv_blocks, bs, config.enable_prefix_caching, len(config.service_classes),
                                 host_tier_for(config, self.runner, self.num_kv_blocks))
        self.scheduler = Scheduler(config, self.kv)
        self.kv.recompute_s = lambda n, computed: recompute_price(self.scheduler.cost, n, computed)
        if self.lora is not None:
            self.scheduler.lora_ready, self.lora.on_remove = self.lora.is_ready, self.kv.drop_adapter
        self.grammars = GrammarManager(grammar_compiler(config.model, mc.vocab_size, mc.eos_token_ids))
        self.scheduler.grammar_ready = self.grammars.is_ready
        # (request id, error) of requests that failed after they were queued (an adapter
        # that could not be read): AsyncEngine hands each to its caller
        self.failed: list[tuple[str, Exception]] = []
        self.class_rank = {name: i for i, name in enumerate(config.service_classes)}
        self.eos_token_ids = set(mc.eos_token_ids)
        # a sequence can grow until the context or the cache its class may use is full
        self.max_seq_len = min(self.max_model_len, self.num_kv_blocks * bs)
        self.max_seq_len_by_rank = [
            min(self.max_model_len, (self.num_kv_blocks - r) * bs) for r in self.scheduler.reserve_by_rank
        ]
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.eos_token_ids,
                                       self.max_seq_len_by_rank)
        self.spec = SpecDecoder(spec, self.kv, config.service_classes, self.max_seq_len_by_rank) if spec else None
        self.scheduler.spec = self.spec
        self.requests: dict[str, RequestState] = {}
        self.timings = StepTimings()
        # tests turn this on: block accounting is checked after every schedule
        self.check_invariants = os.environ.get("LOCKGATE_CHECK_INVARIANTS") == "1"
        self.track_kv_utilization = False   # the benchmark turns it on (it walks every table)
        # the latest step's time as predicted before it ran, and as measured
        self.last_step_predicted_s: float | None = None
        self.last_step_s: float | None = None
        self.kv_util_sum = 0.0
        logger.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens",
            config.model, self.device, self.dtype, self.num_kv_blocks, bs,
        )

    def _start_runner(self, pooled: bool) -> tuple[LoRAManager | None, int]:
        """Adapters, the KV cache sized and (alone) the weights loaded; the other ranks stop
        if any of it fails. The adapter manager and the KV block count."""
        try:
            self.lora = self._enable_lora()
            num_blocks = self._size_kv_cache(pooled)
            self.runner.allocate_kv_cache(num_blocks, self.config.block_size)
            if not pooled:
                self.runner.load()
        except BaseException:
            self.runner.shutdown()
            raise
        return self.lora, num_blocks

    def _enable_lora(self) -> LoRAManager | None:
        """The runner's adapter manager when the config enables LoRA, else None."""
        config = self.config
        if not config.enable_lora:
            return None
        return self.runner.enable_lora(
            max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
            # EngineConfig fills None in with max_loras
            max_cpu_loras=config.max_loras if config.max_cpu_loras is None else config.max_cpu_loras,
        )

    def _size_kv_cache(self, pooled: bool) -> int:
        """The KV cache's block count. Alone, from this model's own memory budget (which it
        keeps in `memory`); in a pool, from the configured blocks or bytes (the pool
        reserves this model's footprint when it loads it)."""
        config, bs = self.config, self.config.block_size
        per_block = self.runner.bytes_per_block(bs)
        if pooled:
            if config.num_kv_blocks is not None:
                num_blocks = config.num_kv_blocks
            else:
                kv_bytes = config.kv_cache_memory if config.kv_cache_memory is not None else CPU_DEFAULT_KV_BYTES
                num_blocks = kv_bytes // per_block
            if num_blocks < 1:
                raise ValueError(f"kv cache: no room for a single block ({per_block} bytes) for {self.name}")
            return num_blocks
        self.memory = MemoryBudget.for_device(
            self.device,
            gpu_memory_utilization=config.gpu_memory_utilization,
            kv_cache_memory=config.kv_cache_memory,
            weight_bytes=self.runner.weight_bytes,
            lora_bytes=self.lora.slot_bytes if self.lora else 0,
        )
        own = self.memory.kv_blocks(per_block, num_kv_blocks=config.num_kv_blocks,
                                    kv_cache_memory=config.kv_cache_memory)
        num_blocks = self.runner.num_blocks_all_ranks(own)     # the fewest any rank holds
        if num_blocks < own:
            self.memory.reserve("kv_cache", num_blocks * per_block)
        return num_blocks

    @property
    def num_generated_tokens(self) -> int:
        return self.outputs.num_generated_tokens

    # -- residency (a pool's models) ----------------------------------------------------------
    @property
    def resident(self) -> bool:
        return self.runner.resident

    def footprint(self) -> dict[str, int]:
        """What this model holds on the device while resident, by part."""
        out = {"weights": self.runner.weight_bytes,
               "kv_cache": self.num_kv_blocks * self.runner.bytes_per_block(self.config.block_size)}
        if self.lora is not None:
            out["lora_slots"] = self.lora.slot_bytes
        return out

    def load(self) -> None:
        self.runner.load()

    def offload(self) -> None:
        """Running requests preempted (back to the queue, in place), cached prefixes forgotten, memory given back."""
        self.scheduler.preempt_all()
        self.kv.reset()
        self.runner.offload()

    def core_for(self, model: str | None) -> EngineCore:
        """The core serving `model` (None: the default): this one."""
        if model is not None and model not in self.served_model_names:
            raise UnknownModel(f"model: {model!r} is not served by this engine")
        return self

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.scheduler.fair.weights[tenant] = float(weight)

    def purge_tenant(self, tenant: str) -> None:
        self.kv.drop_tenant(tenant)    # both KV tiers, before the next lookup (any thread)

    def rebuild_ranks(self, failed_at: float) -> None:
        """A rank failed: every request forgotten (their callers told by AsyncEngine), the
        cached prefixes too (the fresh ranks' caches are empty), and a fresh rank group."""
        for rid in list(self.requests):
            self.abort_request(rid)
        self.kv.reset()
        self.runner.rebuild_ranks(failed_at)

    def shutdown(self) -> None:
        if self.lora is not None:
            self.lora.shutdown()
        self.runner.shutdown()

    # -- requests ------------------------------------------------------------------------
    def validate(self, req: EngineRequest) -> None:
        """Raise InvalidRequest (naming the field) for anything that could never run."""
        check_request(req, self.model_config.vocab_size, self.max_model_len)
        if req.request_id in self.requests:
            raise InvalidRequest(f"request_id: {req.request_id!r} is already in the engine",
                                 field="request_id")
        ids = req.prompt_token_ids
        if req.service_class not in self.class_rank:
            raise InvalidRequest(
                f"service_class: {req.service_class!r} is not one of {list(self.config.service_classes)}",
                field="service_class",
            )
        if len(ids) >= self.max_seq_len_by_rank[self.class_rank[req.service_class]]:
            raise PromptTooLong(
                f"prompt: {len(ids)} tokens cannot fit the KV cache its class may use "
                f"({self.num_kv_blocks} blocks of {self.config.block_size} tokens, "
                f"{self.scheduler.reserve_by_rank[self.class_rank[req.service_class]]} reserved "
                "for more urgent classes)"
            )
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise PromptTooLong(
                f"prompt: {len(ids)} tokens exceed max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens} with chunked prefill disabled"
            )
        if req.model is not None and req.model not in self.served_model_names:
            raise UnknownModel(f"model: {req.model!r} is not served by this engine")
        if req.lora_request is not None:
            self._lora_manager().check_request(req.lora_request)

    @property
    def model_name(self) -> str:
        """The canonical name of the served model (its directory's name)."""
        return self.name

    @property
    def served_model_names(self) -> set[str]:
        return {self.model_name, self.config.model}

    def add_request(self, req: EngineRequest) -> RequestState:
        self.validate(req)
        # one name per variant, so that its prefix-cache hashes agree however it was named
        req = dataclasses.replace(req, model=self.model_name)
        state = RequestState(req=req, class_rank=self.class_rank[req.service_class])
        for i in range(req.sampling.n):
            seq = Sequence(state, i, list(req.prompt_token_ids), len(req.prompt_token_ids))
            self.outputs.start(seq)
            state.seqs.append(seq)
        self.requests[req.request_id] = state
        if req.lora_request is not None:
            self._lora_manager().acquire(req.lora_request)
        self.grammars.add(state)     # compiled off this thread; the request waits for it
        self.scheduler.add(state)
        return state

    def _retire(self, state: RequestState) -> None:
        """The request left the engine (finished, aborted or failed)."""
        self.requests.pop(state.request_id, None)
        self.grammars.forget(state.request_id)
        if state.req.lora_request is not None and self.lora is not None:
            self.lora.release(state.req.lora_request)

    def add_lora(self, lora_request: LoRARequest) -> Adapter:
        """Read and check an adapter into host memory (blocking); the checked adapter."""
        return self._lora_manager().load(lora_request)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequest("lora_request: LoRA is not enabled on this engine (enable_lora=True)",
                                 field="lora_request")
        return self.lora

    def _fail_adapter_requests(self, lora: LoRAManager) -> None:
        for aid, exc in lora.take_failures().items():
            for state in [s for s in self.requests.values() if s.req.lora_id == aid]:
                self._abort_all(state)
                self.failed.append((state.request_id, exc))

    def _fail_grammar_requests(self) -> None:
        for state, exc in self.grammars.take_failures():
            if state.request_id not in self.requests:
                continue    # aborted meanwhile
            self._abort_all(state)
            self.failed.append((state.request_id, exc))

    def _abort_all(self, state: RequestState) -> None:
        for seq in state.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.finish(seq, "abort")
        self._retire(state)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Free the request's blocks at once; returns its last output, finish_reason 'abort'."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        self._abort_all(state)
        state.finished_time = time.time()
        return self.outputs.output(state)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self.threads.tick()
        if self.lora is not None:
            self._fail_adapter_requests(self.lora)
        self._fail_grammar_requests()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.timings.schedule += t1 - t0
        if self.check_invariants:
            self.verify(sched)
        if sched.is_empty:
            if self.lora is not None and any(
                not self.lora.is_ready(s.state.req.lora_id) for s in self.scheduler.waiting if s.state.req.lora_id
            ):
                time.sleep(0.001)   # only adapters still being read: wait for them, do not spin hot
                return []
            if self.grammars.num_pending:
                time.sleep(0.001)   # only grammars still compiling (or just failed: next step)
                return []
            if self.scheduler.waiting or self.scheduler.running:
                # cannot happen for validated requests; fail loudly rather than spin
                raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting")
            return []
        self.timings.num_steps += 1
        if self.track_kv_utilization:
            self.kv_util_sum += self.kv_utilization()
        cost = self.scheduler.cost
        predicted = cost.predict(sched.shape)   # before the step runs: what sizing relied on
        sampled_seqs, out = self.runner.execute(sched, self.kv, self.timings)
        t2 = time.perf_counter()
        accepted = None      # decodes with drafts: how many each kept
        if out is not None and sched.drafts and self.spec is not None:
            sampled_seqs, out, accepted = self.spec.verify(sampled_seqs, out, sched.drafts)
        self.scheduler.update(sched, accepted)
        touched: dict[str, RequestState] = {}
        if out is not None:
            self.outputs.append_tokens(sampled_seqs, out, time.time(), touched)
        for seq in accepted or ():   # its kept drafts are tokens now: their full blocks cached
            if seq.status is SeqStatus.RUNNING:
                self.kv.cache_full_blocks(seq)
        outputs = []
        for state in touched.values():
            if state.finished:
                state.finished_time = time.time()
                self._retire(state)
                outputs.append(self.outputs.output(state))
            elif self.stream_outputs:
                outputs.append(self.outputs.output(state))
        t3 = time.perf_counter()
        self.timings.detokenize += t3 - t2
        cost.observe(sched.shape, t3 - t0, predicted)
        self.threads.observe(t3 - t0, self)
        self.last_step_predicted_s, self.last_step_s = predicted, t3 - t0
        return outputs

    # -- introspection --------------------------------------------------------------------
    def verify(self, sched=None) -> None:
        """Raise if block accounting or a budget is off (see Scheduler.check_invariants)."""
        self.scheduler.check_invariants(sched)

    def kv_utilization(self) -> float:
        """Tokens stored / (blocks held x block size), over the blocks sequences hold now.

        O(sequences), not O(blocks): only a sequence's trailing blocks can be partly filled
        or empty, and those are never shared (prefix hits and siblings share full blocks
        only), so stored = held x block size - the empty rows at each sequence's end. Every
        held block belongs to a running sequence (waiting ones hold none)."""
        held = self.kv.num_used_blocks
        if held == 0:
            return 1.0
        bs = self.config.block_size
        empty_rows = 0
        for seq in self.scheduler.running:
            rows = len(self.kv.blocks_of(seq)) * bs
            empty_rows += rows - min(rows, seq.num_tokens)
        return (held * bs - empty_rows) / (held * bs)

    def stats(self) -> EngineStats:
        sched, classes = self.scheduler, self.config.service_classes
        running = Counter(s.state.req.service_class for s in sched.running)
        waiting = Counter(s.state.req.service_class for s in sched.waiting)
        # requests (not samples) none of whose samples runs yet: what overload limits count
        waiting_reqs = Counter(
            st.req.service_class for st in self.requests.values()
            if not any(q.status is SeqStatus.RUNNING for q in st.seqs)
        )
        per_class = {c: QueueStats(waiting=waiting.get(c, 0), running=running.get(c, 0)) for c in classes}
        tenants = self._tenant_stats(per_class)
        return EngineStats(
            classes=per_class,
            tenants=tenants,
            running={c: running.get(c, 0) for c in classes},
            waiting={c: waiting.get(c, 0) for c in classes},
            waiting_requests={c: waiting_reqs.get(c, 0) for c in classes},
            running_by_tenant=dict(Counter(s.state.req.tenant for s in sched.running)),
            waiting_by_tenant=dict(Counter(s.state.req.tenant for s in sched.waiting)),
            num_requests=len(self.requests),
            num_preemptions=sched.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            num_steps=self.timings.num_steps,
            kv=self.kv.stats(),
            memory=self.memory.summary() if self.memory is not None else self.footprint(),
            cost_model=sched.sizer.cost_summary(str(self.device)),
            lora=self.lora.stats() if self.lora is not None else None,
            parallel=self.runner.parallel_stats(self.timings.forward),
            spec=self.spec.stats() if self.spec is not None else None,
            threads=self.threads.stats(),
        )

    def _tenant_stats(self, per_class: dict[str, QueueStats]) -> dict[str, dict[str, TenantClassStats]]:
        """Per tenant and class: its sequences, service and fairness counter; each class's
        service totals are summed into `per_class` on the way."""
        sched, classes = self.scheduler, self.config.service_classes
        run_ct = Counter((s.state.class_rank, s.state.req.tenant) for s in sched.running)
        wait_ct = Counter((s.state.class_rank, s.state.req.tenant) for s in sched.waiting)
        tenants: dict[str, dict[str, TenantClassStats]] = {}
        for (rank, tenant), ts in sched.tenant_stats.items():
            cls = classes[rank]
            row = TenantClassStats(
                waiting=wait_ct.get((rank, tenant), 0), running=run_ct.get((rank, tenant), 0),
                preemptions=ts.preemptions, prefill_tokens=ts.prefill_tokens,
                decode_tokens=ts.decode_tokens, cached_tokens=ts.cached_tokens,
                counter=sched.fair.counter(rank, tenant), weight=sched.fair.weight(tenant))
            tenants.setdefault(tenant, {})[cls] = row
            total = per_class[cls]
            total.preemptions += row.preemptions
            total.prefill_tokens += row.prefill_tokens
            total.decode_tokens += row.decode_tokens
            total.cached_tokens += row.cached_tokens
        return tenants
