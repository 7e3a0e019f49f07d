"""A tensor-parallel rank other than 0: its own process (`python -m
lockgate.engine.parallel FD`, spawned by executor.py), holding its shard of the weights
and its share of the KV cache (and of the LoRA slots). It reads its slices of the checkpoint, reports how many KV
blocks its memory holds, joins the rank group, then runs every step rank 0 hands it (the
same forward, its heads and its vocabulary slice) until told to stop or rank 0 goes away.

Every message back to rank 0 is ("ok", value) or ("error", "what failed: cause"); a rank that
fails says why and exits, and rank 0 names it."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from lockgate.engine.config import DTYPES, ModelConfig
from lockgate.engine.kv_cache.device_cache import DeviceKVCache
from lockgate.engine.kv_cache.host_tier import HostKVTier
from lockgate.engine.lora import LoRAManager
from lockgate.engine.lora_files import Adapter
from lockgate.engine.memory import MemoryBudget
from lockgate.engine.models import AttentionMetadata, LlamaForCausalLM, load_model, tensor_bytes
from lockgate.engine.models.loader import packed_weight_bytes
from lockgate.engine.parallel.group import RankGroup, open_store
from lockgate.engine.parallel.shard import Shard
from lockgate.engine.parallel.step_channel import StepArrays, StepReceiver

logger = logging.getLogger(__name__)

# a test's way to make one rank fail where a real fault would: "start:RANK" fails that rank's
# start-up after its process is up
FAULT_ENV = "LOCKGATE_TP_FAULT"


@dataclass(slots=True)
class RankSpec:
    """What a rank needs to start: the model, its place in the group, its memory knobs."""

    model_dir: str
    rank: int
    size: int
    dtype: str                  # a key of config.DTYPES
    device: str                 # this rank's own device
    max_model_len: int
    store_port: int
    timeout_s: float            # each collective and each call
    start_timeout_s: float      # reading its shard and joining the group
    num_threads: int
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    lora_slots: tuple[int, int] | None = None    # (max_loras, max_lora_rank) where LoRA is on
    backend: str = "mp"                          # how ranks 1..N-1 start: processes, or Ray actors


@dataclass(frozen=True, slots=True)
class RankCapacity:
    """A rank's reply once it has read its shard: how many KV blocks it can hold, and its memory."""

    rank: int
    device: str
    kv_blocks: int
    weights_bytes: int
    kv_bytes_per_block: int
    pid: int


class RankWorker:
    def __init__(self, spec: RankSpec, conn: Connection) -> None:
        self.spec, self.conn = spec, conn
        self.device = torch.device(spec.device)
        self.dtype = DTYPES[spec.dtype]
        self.cfg = ModelConfig.from_dir(spec.model_dir)
        self.cfg.context_length(spec.max_model_len)
        self.shard = Shard(spec.rank, spec.size)
        _, kv_heads = self.shard.kv_heads(self.cfg)
        self.kv = DeviceKVCache(self.cfg.num_hidden_layers, kv_heads, self.cfg.head_dim, self.dtype, self.device)
        self.model: LlamaForCausalLM | None = None
        self.lora: LoRAManager | None = None     # its device slots only: rank 0 keeps the adapters
        self.tier: HostKVTier | None = None      # its heads' host KV tier: rank 0 keeps the index
        self.group: RankGroup | None = None
        self.receiver = StepReceiver(conn)

    def start(self) -> None:
        spec = self.spec
        torch.set_num_threads(spec.num_threads)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if os.environ.get(FAULT_ENV) == f"start:{spec.rank}":
            raise RuntimeError(f"{FAULT_ENV} asked rank {spec.rank} to fail at start-up")
        self.load()
        self._reply("ok", self.capacity())
        store = open_store("127.0.0.1", spec.store_port, spec.size, is_server=False, timeout_s=spec.timeout_s)
        self.group = RankGroup(store, spec.rank, spec.size, self.device, spec.timeout_s)
        self._model().tp.comm = self.group
        self._reply("ok", "joined")

    def capacity(self) -> RankCapacity:
        """The KV blocks this rank's memory holds (rank 0 takes the fewest of any rank), and
        what its memory holds besides (shown by the engine's stats)."""
        spec, model = self.spec, self._model()
        weights = tensor_bytes(model) + packed_weight_bytes(model, self.device, self.dtype)
        weights += self.lora.slot_bytes if self.lora is not None else 0
        budget = MemoryBudget.for_device(self.device, gpu_memory_utilization=spec.gpu_memory_utilization,
                                         kv_cache_memory=spec.kv_cache_memory, weight_bytes=weights)
        per_block = self.kv.bytes_per_block(spec.block_size)
        blocks = budget.kv_blocks(per_block, num_kv_blocks=spec.num_kv_blocks, kv_cache_memory=spec.kv_cache_memory)
        return RankCapacity(rank=spec.rank, device=spec.device, kv_blocks=blocks, weights_bytes=weights,
                            kv_bytes_per_block=per_block, pid=os.getpid())

    def _model(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("the model is offloaded")
        return self.model

    # -- what rank 0 may ask ------------------------------------------------------------------
    def load(self) -> None:
        if self.model is None:
            s = self.spec
            self.model = load_model(s.model_dir, self.cfg, s.max_model_len, self.dtype, self.device, self.shard)
            self.model.tp.comm = self.group
            if s.lora_slots is not None:
                max_loras, max_rank = s.lora_slots
                self.lora = LoRAManager(self.model.projections(), max_loras=max_loras, max_lora_rank=max_rank,
                                        max_cpu_loras=max_loras, dtype=self.dtype, device=self.device)
                self.lora.bind(self.model.projections())

    def offload(self) -> None:
        self.model = self.lora = None
        self.kv.free()

    def lora_fill(self, slot: int, adapter: Adapter) -> None:
        """Rank 0 put `adapter` in `slot`: this rank's cut of it in its own slot."""
        self._lora().fill_slot(slot, adapter)

    def lora_clear(self, slot: int) -> None:
        self._lora().clear_slot(slot)

    def _lora(self) -> LoRAManager:
        if self.lora is None:
            raise RuntimeError("an adapter arrived with LoRA off or the model offloaded")
        return self.lora

    def kv_allocate(self, num_blocks: int, block_size: int) -> None:
        self.kv.allocate(num_blocks, block_size)

    def kv_copy(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_blocks(src, dst)

    def kv_free(self) -> None:
        self.kv.free()

    def kv_tier_copy(self, num_slots: int, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """Rank 0's host-tier copies on this rank's heads (its tier made on first use)."""
        if self.tier is None or self.tier.num_slots != num_slots:
            self.tier = HostKVTier(self.kv, num_slots, self.spec.block_size)
        self.tier.copy(stores, loads)

    CALLS = frozenset({"load", "offload", "kv_allocate", "kv_copy", "kv_free", "kv_tier_copy", "lora_fill",
                       "lora_clear"})

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> int:
        while True:
            if not self.conn.poll(1.0):
                continue
            try:
                message = self.conn.recv_bytes()
            except (EOFError, OSError):
                return 0            # rank 0 is gone: so is the group
            kind, payload = self.receiver.decode(message)
            if kind == "stop":
                return 0
            if kind == "call":
                method, kwargs = payload
                if method not in self.CALLS:
                    raise RuntimeError(f"unknown call {method!r}")
                self._reply("ok", getattr(self, method)(**kwargs))
            else:
                self.step(payload)

    @torch.inference_mode()
    def step(self, a: StepArrays) -> None:
        if self.model is None:
            raise RuntimeError("a step arrived while the model is offloaded")
        dev = self.device
        meta = AttentionMetadata(slot_mapping=a.slot_mapping.to(dev), block_tables=a.block_tables.to(dev),
                                 seq_lens=a.seq_lens.to(dev), query_start_loc=a.query_start_loc.to(dev))
        if a.lora_seg_slots.numel():
            self._lora().set_batch(a.lora_seg_starts.tolist(), a.lora_seg_slots.tolist())
        elif self.lora is not None:
            self.lora.clear_batch()
        hidden = self.model(a.input_ids.to(dev), a.positions.to(dev), self.kv.layers, meta)
        if a.logits_indices.numel():
            self.model.compute_logits(hidden[a.logits_indices.to(dev)])   # its slice, gathered on rank 0

    def _reply(self, status: str, value: Any) -> None:
        self.conn.send_bytes(pickle.dumps((status, value)))

    def close(self) -> None:
        self.receiver.close()
        if self.group is not None:
            self.group.close()


def main(argv: list[str]) -> int:
    return serve(Connection(int(argv[1])))


def serve(conn: Connection) -> int:
    """A rank's life on its control connection (a spawned process's inherited socket, or a
    Ray actor's, ray_ranks.py): its spec, start-up, then steps until stopped; the exit code."""
    worker: RankWorker | None = None
    try:
        spec: RankSpec = pickle.loads(conn.recv_bytes())  # noqa: S301 - rank 0's, over a private socketpair
        worker = RankWorker(spec, conn)
        worker.start()
        return worker.run()
    except (EOFError, KeyboardInterrupt):
        return 0
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}")))
        logger.exception("tensor parallel rank failed")
        return 1
    finally:
        if worker is not None:
            worker.close()
