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
    misfit = quantized_misfit(cfg, size)
    if misfit:
        fits = next(n for n in range(size - 1, 0, -1) if _splits(cfg, n) and not quantized_misfit(cfg, n))
        raise ValueError(f"{field}: {misfit}; the largest tensor_parallel_size that fits is {fits}")


def _splits(cfg: ModelConfig, size: int) -> bool:
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return not (nh % size or (nkv % size and size % nkv) or cfg.intermediate_size % size)


def split_layers(cfg: ModelConfig, size: int) -> list[tuple[str, SplitKind, int, int]]:
    """(HF layer, how it is cut, its unsplit size along the cut, one rank's share) per kind of
    projection in a decoder layer."""
    d, inter = cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    kv_share = kv // size if size <= cfg.num_key_value_heads else d
    return [("self_attn.q_proj", "column", q, q // size), ("self_attn.k_proj", "column", kv, kv_share),
            ("self_attn.v_proj", "column", kv, kv_share), ("self_attn.o_proj", "row", q, q // size),
            ("mlp.gate_proj", "column", inter, inter // size), ("mlp.up_proj", "column", inter, inter // size),
            ("mlp.down_proj", "row", inter, inter // size)]


def quantized_misfit(cfg: ModelConfig, size: int) -> str | None:
    """Why a quantized checkpoint's packed tensors cannot be cut `size` ways (None: they can).
    AWQ packs 8 output columns to a word and groups input rows: a column cut must keep whole
    words, a row cut whole groups. GPTQ packs 32 / bits input rows to a word (a row cut keeps
    whole words, and every group: desc_act scatters a group over the input) and its zero points
    32 / bits output columns (a column cut keeps whole words)."""
    q = cfg.quantization
    if not q or size == 1:
        return None
    method = str(q.get("quant_method", "")).lower()
    group = q.get("group_size", q.get("q_group_size", -1))
    pack = 8 if method == "awq" else 32 // int(q.get("bits", 4))
    for layer, kind, total, share in split_layers(cfg, size):
        where = f"layers.*.{layer}'s {'input' if kind == 'row' else 'output'} slice of {share} ({total} / {size})"
        if method == "awq" and kind == "row" and group > 0 and share % group:
            return f"{where} is not a multiple of the AWQ group_size {group}"
        if share % pack and (method == "gptq" or kind == "column"):
            return f"{where} is not a multiple of the {pack} codes a packed {method.upper()} word holds"
    return None


@dataclass(frozen=True, slots=True)
class SplitLayout:
    """How a fused projection's checkpoint tensors are cut for one rank: column-parallel,
    each part p keeps rows ranges[p] of its own tensor; row-parallel, every part keeps input
    columns ranges[0]. (start, count) pairs in the checkpoint's (unsplit) coordinates;
    `totals` the unsplit sizes along the cut (each part's output rows, or the input columns)."""

    kind: SplitKind
    ranges: tuple[tuple[int, int], ...]
    totals: tuple[int, ...]

    def dense_slices(self, part: int, leaf: str, ndim: int) -> tuple[slice, ...]:
        """The slice of a dense checkpoint tensor (weight [out, in], bias [out]) to read."""
        if self.kind == "column":
            start, count = self.ranges[part]
            return (slice(start, start + count),) + (slice(None),) * (ndim - 1)
        start, count = self.ranges[0]
        if leaf == "bias" or ndim == 1:
            return (slice(None),)
        return (slice(None), slice(start, start + count))

    def column(self, part: int) -> tuple[int, int] | None:
        """(start, count) of part `part`'s output rows this rank keeps (None: a row cut)."""
        return self.ranges[part] if self.kind == "column" else None

    def row(self) -> tuple[int, int] | None:
        """(start, count) of the input columns this rank keeps (None: a column cut)."""
        return self.ranges[0] if self.kind == "row" else None
