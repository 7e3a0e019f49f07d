"""Paged attention on the CPU: the reference's prefill path, and every decode of a layer in
one call to a small C kernel (csrc/decode_attention.c) spread over torch's OpenMP threads.

The reference runs one SDPA call per decoding sequence per layer, each on one thread at
about 8 GB/s; the C kernel reads each context once through its block table (no gather, no
padding) with all sequences and KV heads shared out between the threads: on the priority
bench's shapes (64 decodes of 500-1100 tokens, 2 KV heads of 64) 1.9x faster per layer on
two cores. float32 only; other dtypes take the reference.

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

from kernels.cbuild import CKernel
from kernels.dispatch import CHOICES, KernelUnavailable
from kernels.paged_attention import reference

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
    decodes through the C kernel in one call, prefill chunks through the reference.
    `step_cache`: a dict the caller keeps for one forward's layers (same metadata), where
    the decodes' rows are kept after the first layer works them out."""
    split = None if step_cache is None else step_cache.get("cpu_decode_split")
    if split is None:
        split = _DecodeSplit(block_tables, seq_lens, query_start_loc)
        if step_cache is not None:
            step_cache["cpu_decode_split"] = split
    num_kv_heads, _, block_size, _ = key_cache.shape
    if (split.num_decodes == 0 or not query.is_contiguous() or block_size > MAX_BLOCK
            or query.shape[1] > MAX_GROUP * num_kv_heads):
        return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, scale, first_slots)
    out = torch.empty_like(query)
    decode_attention(query, key_cache, value_cache, split.tables, split.seq_rows, split.token_rows,
                     split.ctx_lens, scale, out)
    if split.num_decodes < split.num_seqs:
        reference.prefill_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                    query_start_loc, scale, first_slots, out)
    return out


__all__ = ["KernelUnavailable", "available", "build", "decode_attention", "load", "paged_attention"]
