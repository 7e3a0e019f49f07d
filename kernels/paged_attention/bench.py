"""Bench cases of the paged-attention kernel (`lockgate bench kernels`): Llama-7B-shaped
attention of one layer (32 query heads of 128, block size 16) over scattered block tables
(blocks in random order, as after a while of serving), Triton against the plain-torch
reference.

* `decode b64 ctx4096`: 64 decodes of 4096-token contexts, 32 KV heads (Llama-2-7B). Bound
  "memory": the least a call moves is every context's K and V, read once, plus the
  queries read and the output written.
* `decode b4 ctx32k gqa8`: 4 decodes of 32768 tokens, 8 KV heads (GQA, Llama-3-8B): too
  few (sequence, KV head) programs to fill a GPU, the split-K path. Bound "memory".
* `prefill b4 chunk512 ctx2048 gqa8`: 4 chunks of 512 new tokens at the end of 2048-token
  contexts (chunked prefill). Bound "compute": the causal QK^T and PV products, 2 FLOPs a
  multiply-add, only the (query, key) pairs the mask keeps.

FLOPs of a query over n keys: 4 * heads * n * head_dim (QK^T and PV). quick=True shrinks
every shape (4 and 2 heads of 32, contexts of at most 1024) so that a case runs in well
under a second under Triton's interpreter. The Triton module is imported on the first call
of a `triton` closure, so the cases can be built where triton is not installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from lockgate.kernels.benchcase import BenchCase
from lockgate.kernels.paged_attention import reference

SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@functools.cache
def _triton() -> ModuleType:
    from lockgate.kernels.paged_attention import triton as triton_impl
    return triton_impl


@dataclass(frozen=True, slots=True)
class _Shape:
    name: str
    bound: str
    ctx_lens: tuple[int, ...]    # context length after the step, per sequence
    q_lens: tuple[int, ...]      # new tokens (queries), per sequence
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16


def _shapes(quick: bool) -> list[_Shape]:
    if quick:
        return [
            _Shape("decode b4 ctx64", "memory", (64,) * 4, (1,) * 4, 4, 4, 32),
            _Shape("decode b2 ctx1024 gqa2", "memory", (1024,) * 2, (1,) * 2, 4, 2, 32),
            _Shape("prefill b2 chunk32 ctx64 gqa2", "compute", (64,) * 2, (32,) * 2, 4, 2, 32),
        ]
    return [
        _Shape("decode b64 ctx4096", "memory", (4096,) * 64, (1,) * 64, 32, 32, 128),
        _Shape("decode b4 ctx32k gqa8", "memory", (32768,) * 4, (1,) * 4, 32, 8, 128),
        _Shape("prefill b4 chunk512 ctx2048 gqa8", "compute", (2048,) * 4, (512,) * 4, 32, 8, 128),
    ]


def _work(s: _Shape, esize: int) -> tuple[int, int]:
    """(bytes, flops): each context's K and V read once, queries read, outputs written; and
    the causal products, query i of a chunk of q at the end of c tokens seeing c - q + i + 1."""
    tokens = sum(s.q_lens)
    kv = 2 * sum(s.ctx_lens) * s.num_kv_heads * s.head_dim * esize
    qo = 2 * tokens * s.num_heads * s.head_dim * esize
    keys_seen = sum(q * (c - q) + q * (q + 1) // 2 for c, q in zip(s.ctx_lens, s.q_lens, strict=True))
    return kv + qo, 4 * s.num_heads * s.head_dim * keys_seen


def _case(s: _Shape, device: torch.device, dtype: torch.dtype, seed: int) -> BenchCase:
    g = torch.Generator(device=device).manual_seed(seed)
    per_seq = [-(-c // s.block_size) for c in s.ctx_lens]
    num_blocks = sum(per_seq) + 1
    cache_shape = (s.num_kv_heads, num_blocks, s.block_size, s.head_dim)
    key_cache = torch.randn(cache_shape, generator=g, device=device, dtype=dtype)
    value_cache = torch.randn(cache_shape, generator=g, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=g, device=device)
    width = max(per_seq)
    tables = torch.zeros(len(per_seq), width, dtype=torch.long, device=device)
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = order[used:used + n]
        used += n
    seq_lens = torch.tensor(s.ctx_lens, dtype=torch.long, device=device)
    starts = [0]
    for q in s.q_lens:
        starts.append(starts[-1] + q)
    query_start_loc = torch.tensor(starts, dtype=torch.long, device=device)
    query = torch.randn(starts[-1], s.num_heads, s.head_dim, generator=g, device=device, dtype=dtype)
    scale = s.head_dim ** -0.5
    # computed once per step for every layer by the engine; not part of a layer's time
    first_slots = reference.contiguous_first_slots(tables, seq_lens, s.block_size)
    bytes_moved, flops = _work(s, query.element_size())

    def run_triton() -> torch.Tensor:
        return _triton().paged_attention(query, key_cache, value_cache, tables, seq_lens, query_start_loc, scale)

    def run_reference() -> torch.Tensor:
        return reference.paged_attention(query, key_cache, value_cache, tables, seq_lens, query_start_loc, scale,
                                         first_slots)

    return BenchCase(kernel="paged_attention", name=f"{s.name} {SHORT.get(dtype, dtype)}", bound=s.bound,
                     bytes_moved=bytes_moved, flops=flops, triton=run_triton, reference=run_reference)


def cases(device: torch.device, dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    """The cases above at `dtype` on `device` (quick: the small shapes)."""
    return [_case(s, device, dtype, seed) for seed, s in enumerate(_shapes(quick))]


__all__ = ["cases"]
