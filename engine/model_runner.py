"""Runs one scheduled step on the device: inputs from the scheduler's choice, one forward
over the flattened batch, logits of the last position of each sequence that samples (of
every position of a decode with draft tokens: one sampler row each, in order)."""

from __future__ import annotations

import os
import time
from array import array
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from lockgate.engine.config import ModelConfig
from lockgate.engine.errors import RankFailure
from lockgate.engine.grammar import grammar_bitmask
from lockgate.engine.kv_cache import KVCacheManager
from lockgate.engine.kv_cache.device_cache import DeviceKVCache, KVCacheOps
from lockgate.engine.lora import LoRAManager
from lockgate.engine.models import AttentionMetadata, LlamaForCausalLM, build_skeleton, load_model, tensor_bytes
from lockgate.engine.models.loader import packed_weight_bytes
from lockgate.engine.parallel.executor import GroupKV, RankProcesses
from lockgate.engine.parallel.group import backend_for
from lockgate.engine.parallel.shard import Shard
from lockgate.engine.parallel.step_channel import StepArrays
from lockgate.engine.parallel.worker import RankSpec
from lockgate.engine.request import Sequence
from lockgate.engine.sampler import Sampler, SamplerOutput, SampleRow
from lockgate.engine.scheduler import SchedulerOutput
from lockgate.engine.spec.draft_model import DraftModel
from lockgate.engine.stats import ParallelStats, RankMemory


@dataclass(slots=True)
class StepTimings:
    """Seconds spent in each part of `step()`, summed over steps."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    detokenize: float = 0.0
    num_steps: int = 0

    def as_dict(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in ("schedule", "prepare", "forward", "sample", "detokenize")}


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]
    sample_rows: list[SampleRow]


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        model_config: ModelConfig,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        ranks: RankSpec | None = None,
        draft_dir: str | None = None,
    ) -> None:
        """`ranks`: with tensor parallelism, what ranks 1..N-1 start from (they are spawned
        here, and read their shards while this process goes on); None: one rank, this one.
        `draft_dir`: a draft model for speculative decoding, loaded and offloaded with this one
        (its weights and per-block KV bytes counted in `weight_bytes` and `bytes_per_block`)."""
        self.cfg = model_config
        self.model_dir, self.max_model_len = model_dir, max_model_len
        self.dtype, self.device = dtype, device
        self.shard = Shard(0, ranks.size) if ranks is not None else Shard()
        # shapes and sizes without storage (this rank's shard): what the budget counts before
        # (and while not) loading, and what adapters are checked against
        self.skeleton = build_skeleton(model_config, dtype, self.shard)
        self.weight_bytes = tensor_bytes(self.skeleton) + packed_weight_bytes(self.skeleton, device, dtype)
        self.draft = DraftModel(draft_dir, max_model_len, dtype, device, seed) if draft_dir else None
        self.weight_bytes += self.draft.weight_bytes if self.draft else 0
        self.model: LlamaForCausalLM | None = None
        self.sampler = Sampler(seed, device)
        self.kv = DeviceKVCache(model_config.num_hidden_layers, self.shard.kv_heads(model_config)[1],
                                model_config.head_dim, dtype, device)
        self.ranks = RankProcesses(ranks, device) if ranks is not None else None
        # every rank's KV operations at once: the one interface what moves blocks goes through
        self.kv_ops: KVCacheOps = self.kv if self.ranks is None else GroupKV(self.kv, self.ranks)
        self._ranks_hold_weights = True     # ranks 1..N-1 read theirs when spawned
        # collectives of groups since replaced (seconds, count); the latest step's seconds
        self._comm_before: tuple[float, int] = (0.0, 0)
        self.last_step_collective_s = 0.0
        self.rank_failures = 0
        self.last_recovery_s: float | None = None
        self.block_size = 0
        self.num_blocks = 0
        self.lora: LoRAManager | None = None
        # grammar masks computed during the forward, on a thread of their own: on an
        # accelerator only (on the CPU the forward's threads hold every core, and a thread
        # beside them slows the forward by more than the masks cost)
        self.overlap_masks = device.type != "cpu"
        self._mask_pool: ThreadPoolExecutor | None = None

    def enable_lora(self, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int) -> LoRAManager:
        self.lora = LoRAManager(
            self.skeleton.projections(), max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras, dtype=self.dtype, device=self.device,
        )
        if self.ranks is not None:
            self.lora.remote = self.ranks.call     # slot fills and clears on every rank
        if self.model is not None:
            self.lora.bind(self.model.projections())
        return self.lora

    @property
    def resident(self) -> bool:
        return self.model is not None

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's K and V per layer, what the forward reads."""
        return self.kv.layers

    def load(self) -> None:
        """Weights from the checkpoint (memory-mapped safetensors), the KV cache, the LoRA
        slots: everything the device holds for this model (on every rank)."""
        if self._all_loaded:
            return
        ranks = self.ranks
        model = self._load_weights()
        if ranks is not None:
            if ranks.group is None:
                ranks.connect(ranks.timeout_s)
            elif not self._ranks_hold_weights:
                ranks.call("load")
            self._ranks_hold_weights = True
            model.tp.comm = ranks.group
        if self.lora is not None:
            self.lora.bind(model.projections())
        if self.draft is not None:
            self.draft.load()
        if self.num_blocks:
            self.allocate_kv_cache(self.num_blocks, self.block_size)

    @property
    def _all_loaded(self) -> bool:
        """Every rank holds its weights (and the rank group is up)."""
        ranks = self.ranks
        return self.model is not None and (ranks is None or (ranks.group is not None and self._ranks_hold_weights))

    def _load_weights(self) -> LlamaForCausalLM:
        if self.model is None:
            self.model = load_model(self.model_dir, self.cfg, self.max_model_len, self.dtype, self.device,
                                    self.shard)
        return self.model

    def num_blocks_all_ranks(self, own: int) -> int:
        """The KV blocks every rank can hold: `own` (this rank's) or fewer, where another
        rank's memory holds fewer. Rank 0 reads its shard meanwhile, then waits for the
        others to have read theirs."""
        if self.ranks is None:
            return own
        self._load_weights()
        return min(own, *(c.kv_blocks for c in self.ranks.wait_loaded()))

    def offload(self) -> None:
        """Give the device memory back: weights are dropped (read again from the checkpoint's
        files on `load`), the KV cache and the LoRA slots freed, on every rank."""
        if self.lora is not None:
            self.lora.unbind()
        self.model = None
        self.kv.free()
        if self.draft is not None:
            self.draft.offload()
        if self.ranks is not None and self._ranks_hold_weights:
            self.ranks.call("offload")
            self._ranks_hold_weights = False

    @property
    def collective_s(self) -> float:
        """Seconds this rank has spent in collectives (0 with one rank): against the steps'
        forward time, the share spent communicating."""
        group = self.ranks.group if self.ranks is not None else None
        return self._comm_before[0] + (0.0 if group is None else group.collective_s)

    @property
    def num_collectives(self) -> int:
        group = self.ranks.group if self.ranks is not None else None
        return self._comm_before[1] + (0 if group is None else group.num_collectives)

    def rebuild_ranks(self, failed_at: float) -> None:
        """After a rank failed (the caller has forgotten every request and cached prefix): what
        is left of the old group stopped, fresh ranks spawned from the same spec and joined,
        the model's collectives moved to them, their KV caches allocated (empty). `failed_at`
        (time.monotonic()) is when the failure was seen: the recovery's time counts from it."""
        old = self.ranks
        if old is None:
            raise RuntimeError("one rank: there is no rank group to rebuild")
        self.rank_failures += 1
        self._comm_before = (self.collective_s, self.num_collectives)
        old.close()
        self.ranks = ranks = RankProcesses(old.template, self.device)
        self.kv_ops = GroupKV(self.kv, ranks)
        self._ranks_hold_weights = True
        try:
            ranks.connect(ranks.timeout_s)
            if self.model is not None:
                self.model.tp.comm = ranks.group
                if self.num_blocks:
                    ranks.call("kv_allocate", num_blocks=self.num_blocks, block_size=self.block_size)
        except BaseException:
            ranks.close()
            raise
        self.last_recovery_s = time.monotonic() - failed_at

    def parallel_stats(self, forward_s: float) -> ParallelStats | None:
        """Communication and each rank's memory (None with one rank)."""
        ranks = self.ranks
        if ranks is None:
            return None
        kv_bytes = self.num_blocks * self.bytes_per_block(self.block_size) if self.block_size else 0
        rows = [RankMemory(0, str(self.device), os.getpid(), self.weight_bytes, kv_bytes)]
        rows += [RankMemory(c.rank, c.device, c.pid, c.weights_bytes, self.num_blocks * c.kv_bytes_per_block)
                 for c in ranks.capacities or []]
        return ParallelStats(
            tensor_parallel_size=ranks.size, backend=backend_for(self.device), collective_s=self.collective_s,
            num_collectives=self.num_collectives, forward_s=forward_s,
            last_step_collective_s=self.last_step_collective_s, ranks=rows, rank_failures=self.rank_failures,
            last_recovery_s=self.last_recovery_s)

    def shutdown(self) -> None:
        """Stop the other ranks (a no-op with one)."""
        if self.ranks is not None:
            self.ranks.close()

    def bytes_per_block(self, block_size: int) -> int:
        """This rank's bytes per KV block (its own KV heads; the draft model's beside them)."""
        return self.kv.bytes_per_block(block_size) + (self.draft.bytes_per_block(block_size) if self.draft else 0)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The KV cache's size, allocated now on every rank if the model is loaded, else on
        `load` (see DeviceKVCache.allocate)."""
        self.block_size, self.num_blocks = block_size, num_blocks
        if not self._all_loaded:
            return   # allocated on load
        self.kv_ops.allocate(num_blocks, block_size)
        if self.draft is not None:
            self.draft.allocate(num_blocks, block_size)

    def _order_by_adapter(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """With adapters in the step: sequences grouped by adapter (base model first), each
        adapter's tokens one contiguous segment, and the slots filled; else as scheduled."""
        lora = self.lora
        if lora is None:
            return scheduled
        ids = sorted({seq.state.req.lora_id for seq, _ in scheduled} - {0})
        if not ids:
            lora.clear_batch()
            return scheduled
        slot_of = lora.activate(ids)
        ordered = sorted(scheduled, key=lambda item: item[0].state.req.lora_id)
        starts: list[int] = [0]
        slots: list[int] = []
        for seq, num_new in ordered:
            aid = seq.state.req.lora_id
            slot = slot_of[aid] if aid else -1
            if slots and slots[-1] == slot:
                starts[-1] += num_new
            else:
                slots.append(slot)
                starts.append(starts[-1] + num_new)
        lora.set_batch(starts, slots)
        return ordered

    def prepare(self, sched: SchedulerOutput, kv: KVCacheManager) -> ModelInput:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        starts = [0]
        logits_indices: list[int] = []
        sample_seqs: list[Sequence] = []
        rows: list[SampleRow] = []
        drafts_of = sched.drafts
        for seq, num_new in self._order_by_adapter(sched.scheduled):
            start = seq.num_computed_tokens
            end = start + num_new
            table = kv.block_ids(seq)
            drafts = drafts_of.get(seq) if drafts_of else None
            input_ids.extend(seq.token_ids[start:end] if drafts is None else seq.token_ids[start:] + drafts)
            if num_new == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                pos = range(start, end)
                positions.extend(pos)
                slots.extend([table[p // bs] * bs + p % bs for p in pos])
            tables.append(table)
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
            if drafts is not None:           # a decode with drafts: a token at every position
                logits_indices.extend(range(starts[-2], starts[-1]))
                sample_seqs.append(seq)
                rows += [_sample_row(seq, end - len(drafts) + j, drafts[:j]) for j in range(len(drafts) + 1)]
            elif end == len(seq.token_ids):  # the chunk reaches the end: sample a token
                logits_indices.append(starts[-1] - 1)
                sample_seqs.append(seq)
                rows.append(_sample_row(seq, end))
        width = max(len(t) for t in tables)
        flat: list[int] = []            # the block tables, each padded to the widest
        pad = [0] * width
        for t in tables:
            flat += t
            flat += pad[len(t):]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=_i64(slots, dev),
            block_tables=_i64(flat, dev).view(len(tables), width),
            seq_lens=_i64(seq_lens, dev),
            query_start_loc=_i64(starts, dev),
        )
        return ModelInput(
            input_ids=_i64(input_ids, dev),
            positions=_i64(positions, dev),
            meta=meta,
            logits_indices=_i64(logits_indices, dev),
            sample_seqs=sample_seqs,
            sample_rows=rows,
        )

    def _start_masks(self, rows: list[SampleRow]) -> Future[torch.Tensor] | None:
        """The grammar rows' allowed tokens, computed on a thread of their own while the
        forward runs (llguidance releases the GIL); None when no row has a grammar or
        `overlap_masks` is off (the sampler computes them then)."""
        matchers = [r.grammar for r in rows if r.grammar is not None]
        if not matchers or not self.overlap_masks:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockgate-mask")
        return self._mask_pool.submit(grammar_bitmask, matchers, self.cfg.vocab_size)

    def _loaded(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("the model is offloaded: load() it before running a step")
        return self.model

    @torch.inference_mode()
    def forward_logits(self, inp: ModelInput) -> torch.Tensor:
        model = self._loaded()
        self._hand_off(inp)
        hidden = model(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
        logits = model.compute_logits(hidden[inp.logits_indices])
        if logits is None:
            raise RuntimeError("rank 0 got no logits: the model's rank group is not rank 0's")
        return logits

    def _hand_off(self, inp: ModelInput) -> None:
        """With tensor parallelism: this step's inputs to the other ranks, before rank 0's own
        forward (they meet in its collectives)."""
        if self.ranks is not None:
            m = inp.meta
            arrays = StepArrays(
                inp.input_ids.cpu(), inp.positions.cpu(), m.slot_mapping.cpu(), m.block_tables.cpu(),
                m.seq_lens.cpu(), m.query_start_loc.cpu(), inp.logits_indices.cpu())
            batch = self.lora.batch if self.lora is not None else None
            if batch is not None and batch.active:
                arrays.lora_seg_starts = _i64(batch.seg_starts, torch.device("cpu"))
                arrays.lora_seg_slots = _i64(batch.seg_slots, torch.device("cpu"))
            self.ranks.send_step(arrays)

    @torch.inference_mode()
    def _forward(self, inp: ModelInput) -> torch.Tensor | None:
        """The step's logits (None when no sequence samples); a rank's failure named."""
        try:
            if inp.sample_seqs:
                return self.forward_logits(inp)
            self._hand_off(inp)
            self._loaded()(inp.input_ids, inp.positions, self.kv_caches, inp.meta)
            return None
        except RankFailure as exc:
            raise exc if self.ranks is None else self.ranks.failure(exc) from exc

    @torch.inference_mode()
    def execute(
        self, sched: SchedulerOutput, kv: KVCacheManager, timings: StepTimings
    ) -> tuple[list[Sequence], SamplerOutput | None]:
        t0 = time.perf_counter()
        kv.flush_host_tier()           # blocks the schedule moved between tiers, before anything writes
        if self.draft is not None:     # the draft's KV beside the target's; its tokens into sched.drafts
            self.draft.propose(sched, kv, self.sampler)
        t_draft = time.perf_counter() - t0
        t0 += t_draft
        inp = self.prepare(sched, kv)
        masks = self._start_masks(inp.sample_rows)
        t1 = time.perf_counter()
        comm_before = self.collective_s
        logits = self._forward(inp)
        self.last_step_collective_s = self.collective_s - comm_before
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t2 = time.perf_counter()
        bitmask = masks.result() if masks is not None else None
        out = self.sampler(logits, inp.sample_rows, bitmask) if logits is not None else None
        if self.draft is not None and logits is not None and out is not None:
            self.draft.verify_sampled(logits, inp.sample_seqs, inp.sample_rows, out, sched.drafts, self.sampler)
        t3 = time.perf_counter()
        timings.prepare += t1 - t0
        timings.forward += t2 - t1 + t_draft
        timings.sample += t3 - t2
        return inp.sample_seqs, out


def _sample_row(seq: Sequence, position: int, drafts: list[int] | None = None) -> SampleRow:
    """The sampler's row for `seq`'s token at `position`; `drafts`: draft tokens before it
    (speculative decoding), in its output history as if accepted (what penalties read)."""
    p = seq.state.req.sampling
    hist = p.needs_penalties
    output = (seq.output_token_ids + (drafts or [])) if hist else []
    return SampleRow(p, seq.token_ids[: seq.num_prompt_tokens] if hist else [], output, seq.index, position,
                     seq.grammar)


def _i64(values: list[int], device: torch.device) -> torch.Tensor:
    """torch.tensor(values, dtype=torch.long, device=device), through an array('q') on the
    CPU: array packs the ints in C, where torch.tensor inspects the list element by element
    (a step's inputs are thousands of ints)."""
    if not values or device.type != "cpu":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.frombuffer(array("q", values), dtype=torch.long)
