"""What one tensor-parallel rank holds of a model (Megatron's split): its query heads, its
key/value heads (replicated when there are more ranks than KV heads), its share of the MLP's
intermediate size and of the vocabulary. Pure arithmetic: no processes, no collectives.

Column-parallel projections (q/k/v, gate/up) keep a slice of their output rows; row-parallel
ones (o_proj, down_proj) a slice of their input columns, their partial outputs summed by one
all-reduce. The embedding and the LM head keep a slice of the vocabulary's rows, padded so that
every rank holds as many (the padding rows are zero and never looked up)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lockgate.engine.config import ModelConfig

# how a projection is split: its output rows (column-parallel) or its input columns (row-parallel)
SplitKind = Literal["column", "row"]


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`; Shard() is the whole model (no tensor parallelism)."""

    rank: int = 0
    size: int = 1

    @property
    def whole(self) -> bool:
        return self.size == 1

    def heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first query head, count) this rank computes."""
        per = cfg.num_attention_heads // self.size
        return self.rank * per, per

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first KV head, count): a slice of them, or, with more ranks than KV heads, the one
        KV head its query heads read (replicated on size / num_kv_heads ranks)."""
        nkv = cfg.num_key_value_heads
        if self.size <= nkv:
            per = nkv // self.size
            return self.rank * per, per
        return self.rank * nkv // self.size, 1

    def intermediate(self, cfg: ModelConfig) -> tuple[int, int]:
        per = cfg.intermediate_size // self.size
        return self.rank * per, per

    def vocab_rows(self, vocab_size: int) -> int:
        """Rows of the embedding and the LM head each rank holds (the vocabulary padded)."""
        return -(-vocab_size // self.size)

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """(first token id, count of real rows) of this rank's vocabulary slice."""
        rows = self.vocab_rows(vocab_size)
        start = min(self.rank * rows, vocab_size)
        return start, min(rows, vocab_size - start)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming tensor_parallel_size when the model cannot be split `size` ways."""
    if size == 1:
        return
    field = f"tensor_parallel_size: {size} does not split this model"
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if nh % size:
        raise ValueError(f"{field}: {nh} attention heads are not a multiple of it")
    if nkv % size and size % nkv:
        raise ValueError(f"{field}: {nkv} KV heads neither divide it nor are a multiple of it")
    if cfg.intermediate_size % size:
        raise ValueError(f"{field}: intermediate_size {cfg.intermediate_size} is not a multiple of it")
    if cfg.quantization:
        method = cfg.quantization.get("quant_method")
        raise ValueError(f"tensor_parallel_size: quantized checkpoints ({method!r}) are not split "
                         "across ranks yet; use tensor_parallel_size 1")


@dataclass(frozen=True, slots=True)
class SplitLayout:
    """How a fused projection's checkpoint tensors are cut for one rank: column-parallel,
    each part p keeps rows ranges[p] of its own tensor; row-parallel, every part keeps input
    columns ranges[0]. (start, count) pairs in the checkpoint's (unsplit) coordinates."""

    kind: SplitKind
    ranges: tuple[tuple[int, int], ...]

    def dense_slices(self, part: int, leaf: str, ndim: int) -> tuple[slice, ...]:
        """The slice of a dense checkpoint tensor (weight [out, in], bias [out]) to read."""
        if self.kind == "column":
            start, count = self.ranges[part]
            return (slice(start, start + count),) + (slice(None),) * (ndim - 1)
        start, count = self.ranges[0]
        if leaf == "bias" or ndim == 1:
            return (slice(None),)
        return (slice(None), slice(start, start + count))
