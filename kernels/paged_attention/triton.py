"""Paged attention in Triton: CUDA devices, and the CPU under Triton's interpreter
(TRITON_INTERPRET=1), which is how the tests run it. Same signatures and results (within
float rounding) as `reference.py`, whose docstring has the layouts.

`paged_attention` is one launch for a whole flattened batch, prefill chunks and decodes
mixed. A program takes one KV head and a tile of BLOCK_Q consecutive query tokens of one
sequence, with all GROUP query heads that share that KV head (GQA): BLOCK_Q * GROUP rows,
so each K/V tile read from the cache serves every head of the group. It walks the
sequence's context in tiles of BLOCK_N tokens, each token found through the block table
(block `block_tables[b, p // block_size]`, row `p % block_size`, any block size), up to
the tile's last causal position, with an online softmax: running row maxima and sums, an
fp32 accumulator, exp2 with the scale folded in. Cache offsets are int64: `block_id *
block_size * head_dim`, and a KV head's offset, pass 2**31 elements on large caches.

The grid's first axis is the query tiles. Sequence b's tiles are numbered from
`query_start_loc[b] // BLOCK_Q + b`, which leaves room for its ceil(q_len / BLOCK_Q) tiles;
so the grid, `num_tokens // BLOCK_Q + num_seqs` tiles, is sized on the host without reading
the lengths (no device sync), a program finds its sequence by binary search over
`query_start_loc`, and a tile past its sequence's queries exits at once. A batch of
decodes (as many queries as sequences) takes BLOCK_Q = 1, tile t being query t; one with
prefill chunks takes 64-row tiles.

Split-K ("flash decoding"): when a decode batch has too few programs to fill the device
(a few long contexts), each query's context is cut into NUM_SPLITS pieces, each a program
of its own writing its unnormalised output, row max and row sum in fp32, and a second
small kernel merges the pieces. The longest context is bounded on the host by the block
table's width, so short contexts are never split.

`write_kv_cache` scatters each token's K and V rows to its slot (`slot_mapping`), one
program per KV head and tile of tokens; a negative slot is skipped.

Triton chooses between its interpreter and its compiler when it is imported (triton.language's
own helpers are jitted then): TRITON_INTERPRET=1 must be set before `triton` is first
imported in the process; set later, a launch on CPU tensors raises KernelUnavailable.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton
import triton.language as tl

from lockgate.kernels.dispatch import KernelUnavailable

LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SPLITS = 16            # split-K pieces per decode, at most
MIN_SPLIT_TOKENS = 512     # context tokens per piece, at least
TARGET_PROGRAMS = 256      # decode grids smaller than this are split (H100/H200: 132 SMs)
WRITE_BLOCK_T = 16         # tokens per write_kv_cache program


# -- kernels -------------------------------------------------------------------------------

@triton.jit
def _attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    part_out_ptr, part_ml_ptr,           # split-K partials (NUM_SPLITS > 1 only)
    scale_log2, num_seqs, num_heads,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kh, stride_kb, stride_ks, stride_kd,
    stride_vh, stride_vb, stride_vs, stride_vd,
    stride_btb, stride_btn,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)

    # this tile's sequence: the last b whose first tile is at or before it
    lo = tl.zeros([], tl.int32)
    hi = tl.zeros([], tl.int32) + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid).to(tl.int32)
        if BLOCK_Q > 1:
            first = first // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid)
    seq = lo
    q_start = tl.load(qsl_ptr + seq).to(tl.int32)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int32) - q_start
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    first_tile = q_start // BLOCK_Q + seq if BLOCK_Q > 1 else q_start
    q_tile_start = (tile - first_tile) * BLOCK_Q
    if q_tile_start >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    tok = q_tile_start + rows // GROUP                 # each row's query, within its sequence
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = ctx - q_len + tok                          # its position in the context
    q_rows = q_start.to(tl.int64) + tok
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:        # bfloat16 under the interpreter, whose tl.dot cannot take it (see paged_attention)
        q = q.to(tl.float32)

    # keys [kv_lo, kv_end): all that some row of this tile sees, or this split's share
    kv_end = ctx - q_len + tl.minimum(q_len, q_tile_start + BLOCK_Q)
    kv_lo = tl.zeros([], tl.int32)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = tl.program_id(2) * per_split
        kv_end = tl.minimum(kv_end, kv_lo + per_split)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)      # finite: a row that sees nothing stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    table = bt_ptr + seq.to(tl.int64) * stride_btb
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    for start in range(kv_lo, kv_end, BLOCK_N):
        pos = start + cols
        key_ok = pos < kv_end
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_btn, mask=key_ok, other=0).to(tl.int64)
        slot = (pos % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_head + (block * stride_kb + slot * stride_ks)[None, :] + dims[:, None] * stride_kd,
                    mask=key_ok[None, :] & dim_ok[:, None], other=0.0)          # [D, N]
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        s = tl.where(key_ok[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # V's rows past the context read as 0: an unwritten slot may hold NaN, and 0 * NaN = NaN
        v = tl.load(v_head + (block * stride_vb + slot * stride_vs)[:, None] + dims[None, :] * stride_vd,
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0)          # [N, D]
        if DOT_FP32:    # p rounded to bfloat16 all the same, as the compiled kernel does
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32),
                                                input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if NUM_SPLITS > 1:
        # one query per tile here: partial (tile, split, head), fp32, padded dims included
        part = (tile.to(tl.int64) * NUM_SPLITS + tl.program_id(2)) * num_heads + head
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, num_heads,
    stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # one program per (query, head): its pieces weighted by exp2(piece max - overall max);
    # a piece past the end of a short context saw nothing (max -1e30, sum 0, output 0)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    part = (token * NUM_SPLITS + tl.arange(0, NUM_SPLITS)) * num_heads + head
    dims = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_ml_ptr + part * 2)
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(tl.load(part_ml_ptr + part * 2 + 1) * w, 0)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + dims[None, :])
    o = tl.sum(acc * w[:, None], 0) / denom
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, kc_ptr, vc_ptr, slots_ptr, num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kch, stride_kcb, stride_kcs, stride_kcd,
    stride_vch, stride_vcb, stride_vcs, stride_vcd,
    BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    tok_ok = tokens < num_tokens
    slot = tl.load(slots_ptr + tokens, mask=tok_ok, other=-1).to(tl.int64)
    ok = (tok_ok & (slot >= 0))[:, None] & (dims < HEAD_DIM)[None, :]
    at = (slot // BLOCK_SIZE) * stride_kcb + (slot % BLOCK_SIZE) * stride_kcs
    vat = (slot // BLOCK_SIZE) * stride_vcb + (slot % BLOCK_SIZE) * stride_vcs
    t = tokens.to(tl.int64)
    k = tl.load(key_ptr + t[:, None] * stride_kt + head * stride_kh + dims[None, :] * stride_kd, mask=ok)
    v = tl.load(value_ptr + t[:, None] * stride_vt + head * stride_vh + dims[None, :] * stride_vd, mask=ok)
    tl.store(kc_ptr + head * stride_kch + at[:, None] + dims[None, :] * stride_kcd,
             k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + head * stride_vch + vat[:, None] + dims[None, :] * stride_vcd,
             v.to(vc_ptr.dtype.element_ty), mask=ok)


INTERPRETED = type(_attention_kernel).__name__ == "InterpretedFunction"   # TRITON_INTERPRET=1 at import


# -- launchers ----------------------------------------------------------------------------

def _on(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Launches go to the tensors' CUDA device; CPU tensors need the interpreter. Not
    kernels.dispatch.on_device, which reads TRITON_INTERPRET at call time: this module's
    kernels were made interpreted or compiled when triton was imported (INTERPRETED)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if not INTERPRETED:
        raise KernelUnavailable(f"Triton kernels on {device.type} tensors run in Triton's interpreter, and "
                                "triton was imported without TRITON_INTERPRET=1: set it before triton is imported")
    return contextlib.nullcontext()


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """What the kernel relies on: dtypes, shapes, whole GQA groups."""
    if query.dtype not in DTYPES:
        raise TypeError(f"paged_attention (triton): {query.dtype} is not supported (float16, bfloat16, float32)")
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise TypeError(f"paged_attention (triton): query {query.dtype}, caches {key_cache.dtype}, {value_cache.dtype}")
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape \
            or key_cache.shape[3] != query.shape[2]:
        raise ValueError(f"paged_attention (triton): query {tuple(query.shape)}, key cache "
                         f"{tuple(key_cache.shape)}, value cache {tuple(value_cache.shape)}")
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[0]
    if num_heads % num_kv_heads:
        raise ValueError(f"paged_attention (triton): {num_heads} query heads over {num_kv_heads} KV heads")


def num_splits(programs: int, longest: int) -> int:
    """Split-K pieces per decode: 1 (no split) when the grid has TARGET_PROGRAMS programs
    already or contexts are short, else enough to reach it, each piece at least
    MIN_SPLIT_TOKENS of the longest context (bounded by the table's width); a power of two."""
    if programs >= TARGET_PROGRAMS:
        return 1
    splits = min(MAX_SPLITS, -(-TARGET_PROGRAMS // programs), longest // MIN_SPLIT_TOKENS)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


def launch_config(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  block_size: int, dtype: torch.dtype, longest: int) -> tuple[int, int, dict[str, Any]]:
    """(query tiles, split-K pieces, the attention kernel's constexprs) for a batch; `longest`
    bounds its longest context (the block table's width times the block size)."""
    group = num_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(max(head_dim, 16))
    # 64 keys a step; 32 where the K and V tiles would be large (shared memory on sm_80/86)
    block_n = 64 if head_dim_pad <= 128 and dtype != torch.float32 else 32
    if num_tokens == num_seqs:      # decodes (one query per sequence, or a batch the same size)
        block_q, block_m, num_tiles = 1, max(16, triton.next_power_of_2(group)), num_tokens
        splits = num_splits(num_tokens * num_kv_heads, longest)
    else:                           # prefill chunks: tiles of 64 rows (or one query's group)
        block_m = max(64, triton.next_power_of_2(group))
        block_q, splits = block_m // group, 1
        num_tiles = num_tokens // block_q + num_seqs
    # Triton's interpreter multiplies bfloat16 blocks as their raw bits (numpy has no
    # bfloat16): there the kernel widens them to fp32 before each tl.dot, which then makes
    # the same products as the compiled kernel (bf16 x bf16 is exact in fp32) and sums them
    # in fp32 as it does
    dot_fp32 = dtype == torch.bfloat16 and INTERPRETED
    return num_tiles, splits, {
        "GROUP": group, "BLOCK_Q": block_q, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_SIZE": block_size,
        "HEAD_DIM": head_dim, "HEAD_DIM_PAD": head_dim_pad, "NUM_SPLITS": splits,
        "PRECISION": "ieee" if dtype == torch.float32 or dot_fp32 else "tf32",    # fp32: no TF32 rounding
        "DOT_FP32": dot_fp32,
    }


def paged_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,         # [num_seqs] context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] cumulative query lengths
    scale: float,
    first_slots: list[int] | None = None,
) -> torch.Tensor:
    """As reference.paged_attention. `first_slots`, the reference's hint for contexts that
    are one slice of the cache, is not used: every context is read through its table."""
    del first_slots
    _check(query, key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_tiles, splits, meta = launch_config(num_tokens, num_seqs, num_heads, num_kv_heads, head_dim, block_size,
                                            query.dtype, block_tables.shape[1] * block_size)
    if splits > 1:
        # every (query, split, head) is written: a piece with no keys writes max -1e30, sum 0
        rows = num_tokens * splits * num_heads
        part_out = torch.empty((rows, meta["HEAD_DIM_PAD"]), dtype=torch.float32, device=query.device)
        part_ml = torch.empty((rows, 2), dtype=torch.float32, device=query.device)
    else:
        part_out = part_ml = out        # not touched
    with _on(query.device):
        _attention_kernel[(num_tiles, num_kv_heads, splits)](
            out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            part_out, part_ml, scale * LOG2E, num_seqs, num_heads,
            *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(),
            **meta, num_warps=4, num_stages=2,
        )
        if splits > 1:
            _merge_splits_kernel[(num_tokens, num_heads)](
                out, part_out, part_ml, num_heads, *out.stride(),
                NUM_SPLITS=splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=meta["HEAD_DIM_PAD"], num_warps=4,
            )
    return out


def write_kv_cache(
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,    # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset
) -> None:
    """Write each token's K and V into its slot, in place (a negative slot: not written)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape != value_cache.shape or key_cache.dim() != 4 \
            or key_cache.shape[0] != num_kv_heads or key_cache.shape[3] != head_dim:
        raise ValueError(f"write_kv_cache (triton): key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"caches {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if num_tokens == 0:
        return
    with _on(key.device):
        _write_kv_kernel[(triton.cdiv(num_tokens, WRITE_BLOCK_T), num_kv_heads)](
            key, value, key_cache, value_cache, slot_mapping, num_tokens,
            *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
            BLOCK_T=WRITE_BLOCK_T, BLOCK_SIZE=key_cache.shape[2], HEAD_DIM=head_dim,
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=4,
        )


__all__ = ["launch_config", "num_splits", "paged_attention", "write_kv_cache"]
