"""Paged attention on the CPU: every decode of a layer in one call to a small C kernel
(csrc/decode_attention.c), and every prefill chunk whose context sits in consecutive cache
slots in one call to another (csrc/prefill_attention.c: flash-style causal attention, in place
of one SDPA call per sequence), both spread over torch's OpenMP threads; other chunks take the
reference.

The reference runs one SDPA call per decoding sequence per layer, each on one thread, which
draws only part of the memory bandwidth decode attention is bound by; the C kernel reads
each context once through its block table (no gather, no padding) with all sequences and KV
heads shared out between the threads. float32 only; other dtypes take the reference.

The kernel is built on first use (kernels/cbuild.py: the machine's C compiler, cached per
source, compiler and CPU). `LOCKGATE_KERNELS=reference` keeps the plain-torch path; `cpu`
asks for this one and fails loudly (naming what is missing) where it cannot be built;
unset, the engine takes it where it builds and otherwise says so once in the log and runs
the reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from lockgate.kernels.cbuild import CKernel
from lockgate.kernels.dispatch import CHOICES, KernelUnavailable
from lockgate.kernels.paged_attention import reference
from lockgate.kernels.paged_attention.reference import contiguous_first_slots

SOURCE = Path(__file__).with_name("csrc") / "decode_attention.c"
MAX_BLOCK, MAX_GROUP = 256, 64   # the kernel's limits (csrc): larger shapes take the reference
KERNEL_CHOICES = CHOICES   # LOCKGATE_KERNELS' values, shared by every kernel (kernels/dispatch.py)


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.lg_decode_attention_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64,
                   ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int


KERNEL = CKernel(SOURCE, "CPU attention kernel", _declare)

PREFILL_SOURCE = Path(__file__).with_name("csrc") / "prefill_attention.c"
PREFILL_MAX_GROUP = 8    # query heads a KV head (csrc/prefill_attention.c's MAX_GROUP)


def _declare_prefill(lib: ctypes.CDLL) -> None:
    fn = lib.lg_prefill_attention_f32
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr, ctypes.c_int]
    fn.restype = ctypes.c_int


PREFILL = CKernel(PREFILL_SOURCE, "CPU prefill attention kernel", _declare_prefill)


def prefill_available() -> bool:
    """Whether the prefill kernel runs in this process (see kernels.cbuild.CKernel.available)."""
    return PREFILL.available()


def build(directory: Path | None = None) -> Path:
    """The compiled kernel's path, compiling it if this machine has none yet (KernelUnavailable
    naming what is missing)."""
    return KERNEL.build(directory)


def load() -> ctypes.CDLL:
    return KERNEL.load()


def available() -> bool:
    """Whether the CPU path runs in this process (see kernels.cbuild.CKernel.available)."""
    return KERNEL.available()


def decode_attention(
    query: torch.Tensor,          # [num_tokens, num_heads, head_dim] float32, contiguous
    key_cache: torch.Tensor,      # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,   # [num_seqs, max_blocks] int64
    seq_rows: torch.Tensor,       # [n] int64: the decoding sequences' rows of block_tables
    token_rows: torch.Tensor,     # [n] int64: their query rows
    ctx_lens: torch.Tensor,       # [n] int64: their context lengths (the new token included)
    scale: float,
    out: torch.Tensor,            # written at token_rows
) -> None:
    """One query token per sequence over its paged context, all in one call."""
    lib = load()
    tensors = (query, key_cache, value_cache, block_tables, seq_rows, token_rows, ctx_lens, out)
    if not all(t.is_contiguous() and t.is_cpu for t in tensors):
        raise ValueError("decode_attention: CPU tensors, contiguous")
    if query.dtype != torch.float32 or key_cache.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError("decode_attention: float32 only")
    if any(t.dtype != torch.int64 for t in (block_tables, seq_rows, token_rows, ctx_lens)):
        raise ValueError("decode_attention: int64 index tensors")
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    rc = lib.lg_decode_attention_f32(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], seq_rows.data_ptr(), token_rows.data_ptr(), ctx_lens.data_ptr(),
        seq_rows.numel(), query.shape[1], num_kv_heads, num_blocks, block_size, head_dim,
        float(scale), out.data_ptr(), torch.get_num_threads())
    if rc == 1:
        raise MemoryError("decode_attention: no scratch memory")
    if rc:
        raise ValueError(f"decode_attention: {query.shape[1]} query heads over {num_kv_heads} KV heads, "
                         f"block size {block_size}: at most 64 query heads a KV head, blocks of at most 256")


class _DecodeSplit:
    """A step's decoding sequences (one new token each) as the kernel takes them: the same
    for every layer of a forward, so worked out once when the caller passes a step cache."""

    __slots__ = ("ctx_lens", "num_decodes", "num_seqs", "seq_rows", "tables", "token_rows")

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> None:
        q_lens = query_start_loc[1:] - query_start_loc[:-1]
        self.seq_rows = (q_lens == 1).nonzero().squeeze(1)
        self.num_decodes, self.num_seqs = self.seq_rows.numel(), q_lens.numel()
        self.tables = block_tables.contiguous()
        self.token_rows = query_start_loc[:-1].index_select(0, self.seq_rows).contiguous()
        self.ctx_lens = seq_lens.index_select(0, self.seq_rows).contiguous()


class _PrefillSplit:
    """A step's prefill chunks (more than one new token): those whose context sits in
    consecutive cache slots as the prefill kernel takes them, and the rest (the reference's)."""

    __slots__ = ("ctx_lens", "first_slots", "num_kernel", "others", "q_lens", "q_starts")

    def __init__(self, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, first_slots: list[int]) -> None:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        picked: list[int] = []
        # the reference's chunks: (sequence, first query row, end row, context length)
        self.others: list[tuple[int, int, int, int]] = []
        for b in range(len(lens)):
            if starts[b + 1] - starts[b] > 1:
                if first_slots[b] >= 0:
                    picked.append(b)
                else:
                    self.others.append((b, starts[b], starts[b + 1], lens[b]))
        self.num_kernel = len(picked)
        self.q_starts = torch.tensor([starts[b] for b in picked], dtype=torch.int64)
        self.q_lens = torch.tensor([starts[b + 1] - starts[b] for b in picked], dtype=torch.int64)
        self.ctx_lens = torch.tensor([lens[b] for b in picked], dtype=torch.int64)
        self.first_slots = torch.tensor([first_slots[b] for b in picked], dtype=torch.int64)


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      q_starts: torch.Tensor, q_lens: torch.Tensor, ctx_lens: torch.Tensor,
                      first_slots: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """Causal attention of prefill chunks whose contexts sit in consecutive cache slots (from
    `first_slots`), into `out` at their query rows, all in one call (csrc/prefill_attention.c).
    query/out [T, heads, D] float32 contiguous; head size 64 or 128, at most 8 query heads a
    KV head (ValueError otherwise)."""
    lib = PREFILL.load()
    index = (q_starts, q_lens, ctx_lens, first_slots)
    if not all(t.is_cpu and t.is_contiguous() for t in (query, key_cache, value_cache, out, *index)):
        raise ValueError("prefill_attention: CPU tensors, contiguous")
    if query.dtype != torch.float32 or key_cache.dtype != torch.float32 or out.dtype != torch.float32:
        raise ValueError("prefill_attention: float32 only")
    if any(t.dtype != torch.int64 for t in index):
        raise ValueError("prefill_attention: int64 index tensors")
    if (out.shape != query.shape or value_cache.shape != key_cache.shape or value_cache.dtype != torch.float32
            or query.dim() != 3 or key_cache.dim() != 4 or query.shape[2] != key_cache.shape[3]
            or len({t.numel() for t in index}) != 1):
        raise ValueError(f"prefill_attention: query/out [T, heads, D] over caches [kv_heads, blocks, block, D] "
                         f"and one index entry per sequence; got {tuple(query.shape)}, {tuple(out.shape)}, "
                         f"{tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    num_kv_heads, num_blocks, block_size, head_dim = key_cache.shape
    rc = lib.lg_prefill_attention_f32(
        query.data_ptr(), query.shape[0], key_cache.data_ptr(), value_cache.data_ptr(), num_blocks * block_size,
        q_starts.data_ptr(), q_lens.data_ptr(), ctx_lens.data_ptr(), first_slots.data_ptr(), q_starts.numel(),
        query.shape[1], num_kv_heads, head_dim, float(scale), out.data_ptr(), torch.get_num_threads())
    if rc == 1:
        raise MemoryError("prefill_attention: no scratch memory")
    if rc == 3:
        raise ValueError("prefill_attention: a sequence's query rows or cache slots fall outside the query or the "
                         "cache (nothing read or written)")
    if rc:
        raise ValueError(f"prefill_attention: head size {head_dim} with {query.shape[1]} query heads over "
                         f"{num_kv_heads} KV heads: head sizes 64 or 128, at most 8 query heads a KV head")


def _prefill_kernel_takes(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    return (head_dim in (64, 128) and 1 <= group <= PREFILL_MAX_GROUP and group * num_kv_heads == query.shape[1]
            and prefill_available())


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_slots: list[int] | None = None,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """As reference.paged_attention (same signature and result within float rounding): the
    decodes through the C decode kernel in one call, the prefill chunks whose contexts sit in
    consecutive slots through the C prefill kernel in another, other chunks through the
    reference. `step_cache`: a dict the caller keeps for one forward's layers (same
    metadata), where what is worked out from the metadata is kept after the first layer."""
    split = None if step_cache is None else step_cache.get("cpu_decode_split")
    if split is None:
        split = _DecodeSplit(block_tables, seq_lens, query_start_loc)
        if step_cache is not None:
            step_cache["cpu_decode_split"] = split
    num_kv_heads, _, block_size, _ = key_cache.shape
    if not query.is_contiguous() or block_size > MAX_BLOCK or query.shape[1] > MAX_GROUP * num_kv_heads:
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, first_slots)
    out = torch.empty_like(query)
    if split.num_decodes:
        decode_attention(query, key_cache, value_cache, split.tables, split.seq_rows, split.token_rows,
                         split.ctx_lens, scale, out)
    if split.num_decodes == split.num_seqs:
        return out
    if not _prefill_kernel_takes(query, key_cache):
        reference.prefill_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                    query_start_loc, scale, first_slots, out)
        return out
    pre = None if step_cache is None else step_cache.get("cpu_prefill_split")
    if pre is None:
        if first_slots is None:
            first_slots = contiguous_first_slots(block_tables, seq_lens, block_size)
        pre = _PrefillSplit(seq_lens, query_start_loc, first_slots)
        if step_cache is not None:
            step_cache["cpu_prefill_split"] = pre
    if pre.num_kernel:
        prefill_attention(query, key_cache, value_cache, pre.q_starts, pre.q_lens, pre.ctx_lens,
                          pre.first_slots, scale, out)
    for b, start, end, ctx_len in pre.others:
        reference.prefill_one(query, key_cache, value_cache, block_tables[b], ctx_len, start, end, scale, out)
    return out


__all__ = ["KernelUnavailable", "available", "build", "decode_attention", "load", "paged_attention",
           "prefill_attention", "prefill_available"]
