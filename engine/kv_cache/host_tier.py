"""A second KV tier in host memory: full prefix blocks the device cache evicts are copied
here, and a prompt whose prefix is here gets those blocks copied back instead of computed.

The tier is a bounded pool of block slots (pinned on CUDA; on a CPU device a separate
bounded tensor pool), one [num_kv_heads, num_slots, block_size, head_dim] K and V per layer
like the device cache's, keyed by the device prefix cache's hash chains (which already
hold the model, adapter, tenant scope and salt), least recently used evicted first. Each
entry keeps the tag its block was cached under, (model, adapter id, scope), so an adapter
unload or a deleted tenant drops exactly its own blocks.

Copies are lazy: the block manager records which device block goes to which slot (an
eviction) or back (a hit) while it schedules, and `flush` does them all, batched per layer,
before the step's forward writes into the cache. Stores go first: a block evicted and
refilled from the tier in the same step is saved before it is overwritten.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from lockgate.engine.cost_model import MIN_SAMPLES, StepCostModel
from lockgate.engine.kv_cache.block_pool import BlockHash
from lockgate.engine.kv_cache.device_cache import DeviceKVCache

if TYPE_CHECKING:
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.model_runner import ModelRunner

Tag = tuple[str, int, str]    # (model, adapter id, sharing scope) a block was cached under
GiB = 1024**3


class HostKVTier:
    def __init__(self, device_cache: DeviceKVCache, num_slots: int, block_size: int,
                 also: tuple[DeviceKVCache, ...] = ()) -> None:
        """`also`: caches indexed by the same block ids (a draft model's), kept beside it."""
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size: room for no block in the host tier ({num_slots} slots)")
        self.dev = device_cache
        self.caches = (device_cache, *also)
        self.num_slots, self.block_size = num_slots, block_size
        dc = device_cache
        pin = dc.device.type == "cuda"
        # per cache, per layer; `empty`: host pages are touched only as slots are first filled
        self.host = [[tuple(torch.empty((c.num_kv_heads, num_slots, block_size, c.head_dim), dtype=c.dtype,
                                        pin_memory=pin) for _ in "kv") for _ in range(c.num_layers)]
                     for c in self.caches]
        self.entries: OrderedDict[BlockHash, tuple[int, Tag]] = OrderedDict()   # LRU first
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self._stores: list[tuple[int, int]] = []      # (slot, device block) to copy out
        self._loads: list[tuple[int, int]] = []       # (slot, device block) to copy in
        self._loading: set[int] = set()                # slots a pending load reads: not reused
        self._freed_after_flush: list[int] = []        # dropped while a pending load read them
        # seconds per block copied in: copy-in time over blocks, both decayed sums over the
        # flushes (a first guess of ~4 GB/s), so large copies weigh as much as they cost
        self._copy_s, self._copied = sum(c.bytes_per_block(block_size) for c in self.caches) / 4e9, 1.0
        self.num_stores = self.num_copy_ins = self.num_evictions = 0
        self.num_queries = self.num_hits = 0           # in tokens, past the device cache's hits
        # told ("stored" | "removed", hash) as entries come and go, ("cleared", None) when all
        # go: the same shape as the block pool's, for a pool's KV events with tier "host"
        self.listener: Callable[[str, BlockHash | None], None] | None = None
        # tensor parallelism: the same copies on every other rank (each holds its own KV
        # heads' tier), after this rank's
        self.remote: Callable[[list[tuple[int, int]], list[tuple[int, int]]], None] | None = None

    @property
    def num_held(self) -> int:
        return len(self.entries)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def store(self, block_hash: BlockHash, tag: Tag, block_id: int) -> None:
        """Keep device block `block_id` (being evicted, its contents intact until this step's
        forward) under `block_hash`. A block already held is only marked recently used: a
        prefix copied in and evicted again costs no second copy."""
        entry = self.entries.get(block_hash)
        if entry is not None:
            self.entries.move_to_end(block_hash)
            return
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            oldest, (slot, _) = next(iter(self.entries.items()))
            if slot in self._loading:     # this step still reads it: keep it, drop the newcomer
                return
            del self.entries[oldest]
            self.num_evictions += 1
            if self.listener is not None:
                self.listener("removed", oldest)
        self.entries[block_hash] = (slot, tag)
        self._stores.append((slot, block_id))
        self.num_stores += 1
        if self.listener is not None:
            self.listener("stored", block_hash)

    def count_run(self, hashes: Iterable[BlockHash]) -> int:
        """How many of `hashes`, from the first on, the tier holds; each marked recently used
        (so making room for their copy-in evicts others)."""
        n = 0
        for h in hashes:
            if h not in self.entries:
                break
            self.entries.move_to_end(h)
            n += 1
        return n

    def load(self, block_hash: BlockHash, block_id: int) -> bool:
        """Copy the block held under `block_hash` into device block `block_id` (at `flush`)."""
        entry = self.entries.get(block_hash)
        if entry is None:
            return False
        self.entries.move_to_end(block_hash)
        self._loads.append((entry[0], block_id))
        self._loading.add(entry[0])
        self.num_copy_ins += 1
        return True

    def drop(self, match: Callable[[Tag], bool]) -> int:
        """Forget every block whose tag matches (an adapter unloaded, a tenant deleted)."""
        gone = [h for h, (_, tag) in self.entries.items() if match(tag)]
        for h in gone:
            slot, _ = self.entries.pop(h)
            (self._freed_after_flush if slot in self._loading else self.free_slots).append(slot)
            if self.listener is not None:
                self.listener("removed", h)
        return len(gone)

    def clear(self) -> None:
        """Forget everything, pending copies too (the device cache was dropped, the weights
        may be read again changed: no block is known valid)."""
        self._stores, self._loads, self._loading, self._freed_after_flush = [], [], set(), []
        self.entries.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        if self.listener is not None:
            self.listener("cleared", None)

    def flush(self) -> None:
        """Do the recorded copies: device -> host for evicted blocks, then host -> device."""
        stores, loads = self._stores, self._loads
        if not stores and not loads:
            return
        self._stores, self._loads, self._loading = [], [], set()
        self.free_slots += self._freed_after_flush
        self._freed_after_flush = []
        self.copy(stores, loads)
        if self.remote is not None:
            self.remote(stores, loads)

    def copy(self, stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
        """The copies themselves, (slot, device block) each: `stores` out, then `loads` in."""
        dev = self.dev.device
        if stores:
            slots = torch.tensor([s for s, _ in stores], dtype=torch.long)
            ids = torch.tensor([b for _, b in stores], dtype=torch.long, device=dev)
            for (k, v), (hk, hv) in self._pairs():
                hk.index_copy_(1, slots, k.index_select(1, ids).to("cpu"))
                hv.index_copy_(1, slots, v.index_select(1, ids).to("cpu"))
        if loads:
            t0 = time.perf_counter()
            slots = torch.tensor([s for s, _ in loads], dtype=torch.long)
            ids = torch.tensor([b for _, b in loads], dtype=torch.long, device=dev)
            for (k, v), (hk, hv) in self._pairs():
                k.index_copy_(1, ids, hk.index_select(1, slots).to(dev, non_blocking=True))
                v.index_copy_(1, ids, hv.index_select(1, slots).to(dev, non_blocking=True))
            self._copy_s = 0.95 * self._copy_s + time.perf_counter() - t0
            self._copied = 0.95 * self._copied + len(loads)

    def _pairs(self) -> Iterator[tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]]:
        """(device K and V, host K and V) of every layer of every cache."""
        for cache, host in zip(self.caches, self.host, strict=True):
            yield from zip(cache.layers, host, strict=True)

    @property
    def copy_s_per_block(self) -> float:
        return self._copy_s / self._copied

    def worth_copying(self, num_blocks: int, recompute_s: float | None) -> bool:
        """A copy-in against a recompute of the same tokens (the step-cost model's price;
        None while its fit is not trusted: copy, it is nearly always cheaper). Refused only
        when clearly dearer: the fit's price of a small chunk swings from step to step."""
        return recompute_s is None or num_blocks * self.copy_s_per_block < 2 * recompute_s


def recompute_price(cost: StepCostModel, num_tokens: int, computed: int) -> float | None:
    """Seconds the step-cost model says `num_tokens` more prefill tokens (after `computed`)
    add to a step, once its fit is trusted: 4x the steps it needs to predict at all, and
    recent predictions within 25% (median); else None."""
    err = cost.prediction_error()
    if cost.num_samples < 4 * MIN_SAMPLES or err is None or err > 0.25:
        return None
    return cost.chunk_time(num_tokens, computed)


def host_tier_for(config: EngineConfig, runner: ModelRunner, num_blocks: int) -> HostKVTier | None:
    """The host tier `config` asks for, or None: off (size 0, no prefix caching, or no room
    for a block). A draft model's KV is kept beside the target's; under tensor parallelism
    each rank keeps its own heads' blocks in the same slots (`kv_tier_copy`)."""
    if not config.enable_prefix_caching:
        return None
    per_block = runner.bytes_per_block(config.block_size)      # the draft's included
    slots = host_tier_slots(config.kv_offloading_size, num_blocks * per_block, per_block)
    if not slots:
        return None
    tier = HostKVTier(runner.kv, slots, config.block_size, (runner.draft.kv,) if runner.draft is not None else ())
    if runner.ranks is not None:
        def remote(stores: list[tuple[int, int]], loads: list[tuple[int, int]]) -> None:
            if runner.ranks is not None:      # (rebuilt ranks: the runner's current group)
                runner.ranks.call("kv_tier_copy", num_slots=slots, stores=stores, loads=loads)
        tier.remote = remote
    return tier


def host_tier_slots(size_gib: float | None, device_cache_bytes: int, bytes_per_block: int) -> int:
    """Slots of the host tier. `size_gib` None: on where memory allows, min(the device cache's
    size, a quarter of the host's available memory, 16 GiB); 0: off."""
    size = (min(device_cache_bytes, host_available_bytes() // 4, 16 * GiB) if size_gib is None
            else int(size_gib * GiB))
    return max(0, size // bytes_per_block) if bytes_per_block else 0


def host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
