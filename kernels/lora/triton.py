"""Multi-LoRA in Triton: shrink and expand kernels, per token (BGMV) and per segment (SGMV),
behind wrappers with the reference's signatures (`lora_shrink_expand`, `sgmv`).

The delta added for token t of slot s = slot[t] >= 0 is scaling[s] * (x[t] @ A_s^T) @ B_s^T,
as in reference.py, in two launches:

* shrink: x [T, in] against lora_a [slots, r_max, in] -> a float32 partial buffer
  [split_k, T, r_max]. The reduction over `in` (4096 and more) is split `split_k` ways so
  that a decode batch (tens of tokens, rank 16) still fills the GPU; each split writes its
  own partial sum, and the expand adds them up, so the result does not depend on the order
  the programs run in (no atomics).
* expand: the shrunk rows against lora_bt [slots, r_max, hi - lo] (B transposed; the
  per-token wrapper passes `lora_b.transpose(1, 2)`, a view, and the kernels read any
  strides), scaled by the slot's scaling, accumulated in float32, added into
  out[:, lo:hi] in place and stored in out's dtype. Tokens with slot -1 are not written.

Two forms of each:

* BGMV (`bgmv_shrink`, `bgmv_expand`): one program per (token, block), the token's slot
  read from `slot_per_token` on the device: a gathered matrix-vector product, no sort and no
  host sync. The decode form; `lora_shrink_expand` uses it.
* SGMV (`sgmv_shrink`, `sgmv_expand`): the batch is already grouped into contiguous segments
  of one slot each (Punica's seg_indptr); each segment is cut into tiles of BLOCK_M rows and
  each tile does a `tl.dot` against its slot's matrices, so an adapter's weights are read
  once per tile rather than once per token. The prefill form; `sgmv` uses it.

`lora_masked` has no Triton form: its mask is a general [T, slots * r_max] scaling matrix,
which cannot be turned back into one slot per token without inspecting it on the device
(a host sync), and it is three dense GEMMs that cuBLAS already runs well; kernels/lora
keeps the reference for it.

Differences from the reference, all within float rounding: the shrunk intermediate stays in
float32 (the reference rounds it to x's dtype), except that the SGMV expand feeds it to the
tensor cores in the weights' 16-bit dtype; the scaled delta is added to `out` in float32 and
rounded once. float32 inputs use exact ("ieee") dots, not TF32. A slot outside
[-1, num_slots) raises IndexError when the slots are known on the host (segments, or a CPU
`slot_per_token`); on the device the kernels skip such a token rather than read out of
bounds, since checking would cost a host sync.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) `tl.dot` mistakes bfloat16
operands (stored as uint16 there) for integers, so there the SGMV kernels upcast bfloat16
operands to float32 before the dot; on a GPU they use the bfloat16 tensor-core dot.
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
import triton.language as tl

from lockgate.kernels.dispatch import interpreting, on_device
from lockgate.kernels.lora.reference import check_shrink_expand_args

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# programs a launch should reach on a GPU before the shrink stops splitting its reduction
_TARGET_PROGRAMS = 512


# ------------------------------------------------------------------------------- kernels
@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, part_ptr,
    K, R, num_slots, k_per_split,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_ps, stride_pt, stride_pr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """part[split, t, r block] = sum over this split's k of x[t, k] * A[slot[t], r, k]."""
    t = tl.program_id(0).to(tl.int64)
    rb = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    r_offs = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r_offs < R
    a_rows = a_ptr + slot * stride_as + r_offs[:, None] * stride_ar
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    k_begin = split * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        xv = tl.load(x_ptr + t * stride_xt + k_offs * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
        av = tl.load(a_rows + k_offs[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :],
                     other=0.0).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(part_ptr + split * stride_ps + t * stride_pt + r_offs * stride_pr, acc, mask=r_mask)


@triton.jit
def _bgmv_expand_kernel(
    part_ptr, bt_ptr, out_ptr, slot_ptr, scale_ptr,
    N, R, num_slots, split_k,
    stride_ps, stride_pt, stride_pr,
    stride_bs, stride_br, stride_bn,
    stride_ot, stride_on,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out[t, n block] += scale[slot[t]] * (sum of the partials of t) @ Bt[slot[t], :, n block]."""
    t = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    n_offs = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_offs = r0 + tl.arange(0, BLOCK_R)
        r_mask = r_offs < R
        shrunk = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for sp in range(0, split_k):
            shrunk += tl.load(part_ptr + sp * stride_ps + t * stride_pt + r_offs * stride_pr,
                              mask=r_mask, other=0.0)
        bv = tl.load(bt_ptr + slot * stride_bs + r_offs[:, None] * stride_br + n_offs[None, :] * stride_bn,
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(shrunk[:, None] * bv, axis=0)
    scale = tl.load(scale_ptr + slot).to(tl.float32)
    o_ptrs = out_ptr + t * stride_ot + n_offs * stride_on
    old = tl.load(o_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (old + scale * acc).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _sgmv_tile(tile_ptr, tile, BLOCK_M: tl.constexpr):
    """Tile `tile` of an SGMV launch: its BLOCK_M row offsets, which of them are its rows, and
    its slot (tile i is rows tiles[i, 0]:tiles[i, 1], all of slot tiles[i, 2])."""
    row0 = tl.load(tile_ptr + tile * 3).to(tl.int64)
    row1 = tl.load(tile_ptr + tile * 3 + 1).to(tl.int64)
    slot = tl.load(tile_ptr + tile * 3 + 2).to(tl.int64)
    m_offs = row0 + tl.arange(0, BLOCK_M)
    return m_offs, m_offs < row1, slot


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, tile_ptr, part_ptr,
    K, R, k_per_split,
    stride_xt, stride_xk,
    stride_as, stride_ar, stride_ak,
    stride_ps, stride_pt, stride_pr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    """part[split, rows of the tile, r block] = x[rows, this split's k] @ A[slot, r block, k]^T;
    tile i is rows tiles[i, 0]:tiles[i, 1], all of slot tiles[i, 2]."""
    m_offs, m_mask, slot = _sgmv_tile(tile_ptr, tl.program_id(0), BLOCK_M)
    rb = tl.program_id(1)
    split = tl.program_id(2)
    r_offs = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r_offs < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = split * k_per_split
    for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
        k_offs = k0 + tl.arange(0, BLOCK_K)
        k_mask = k_offs < K
        xv = tl.load(x_ptr + m_offs[:, None] * stride_xt + k_offs[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # A^T block [BLOCK_K, BLOCK_R]
        av = tl.load(a_ptr + slot * stride_as + k_offs[:, None] * stride_ak + r_offs[None, :] * stride_ar,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(xv.to(tl.float32), av.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, av, acc)
    tl.store(part_ptr + split * stride_ps + m_offs[:, None] * stride_pt + r_offs[None, :] * stride_pr, acc,
             mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _sgmv_expand_kernel(
    part_ptr, bt_ptr, out_ptr, tile_ptr, scale_ptr,
    N, R, split_k,
    stride_ps, stride_pt, stride_pr,
    stride_bs, stride_br, stride_bn,
    stride_ot, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
):
    """out[rows of the tile, n block] += scale[slot] * shrunk[rows] @ Bt[slot, :, n block]."""
    m_offs, m_mask, slot = _sgmv_tile(tile_ptr, tl.program_id(0), BLOCK_M)
    nb = tl.program_id(1)
    n_offs = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n_offs < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r_offs = r0 + tl.arange(0, BLOCK_R)
        r_mask = r_offs < R
        p_mask = m_mask[:, None] & r_mask[None, :]
        shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for sp in range(0, split_k):
            shrunk += tl.load(part_ptr + sp * stride_ps + m_offs[:, None] * stride_pt + r_offs[None, :] * stride_pr,
                              mask=p_mask, other=0.0)
        bv = tl.load(bt_ptr + slot * stride_bs + r_offs[:, None] * stride_br + n_offs[None, :] * stride_bn,
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(shrunk, bv.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(shrunk.to(bv.dtype), bv, acc)
    scale = tl.load(scale_ptr + slot).to(tl.float32)
    o_ptrs = out_ptr + m_offs[:, None] * stride_ot + n_offs[None, :] * stride_on
    o_mask = m_mask[:, None] & n_mask[None, :]
    old = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (old + scale * acc).to(out_ptr.dtype.element_ty), mask=o_mask)


# ------------------------------------------------------------------------------- launch
def _launch(kernel: triton.JITFunction, grid: tuple[int, ...], *args: object, **meta: object) -> None:
    """Every launch goes through here (tests count the programs of each grid), on the device
    of its tensors."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    with on_device(device):
        kernel[grid](*args, **meta)


def _pow2(n: int, lo: int, hi: int) -> int:
    """next power of two >= n, clamped to [lo, hi]."""
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def _rank_block(r_max: int) -> int:
    return _pow2(r_max, 16, 64)


def _split_k(k: int, block_k: int, programs: int) -> tuple[int, int]:
    """(split_k, k_per_split): split the reduction over k until the launch has about
    _TARGET_PROGRAMS programs (GPU); none under the interpreter, which runs them one by one."""
    chunks = triton.cdiv(k, block_k)
    split = 1 if interpreting() else max(1, min(chunks, triton.cdiv(_TARGET_PROGRAMS, max(programs, 1))))
    per_split = triton.cdiv(chunks, split) * block_k
    return triton.cdiv(k, per_split), per_split


def _dot_f32(dtype: torch.dtype) -> bool:
    """Whether the SGMV dots run in float32: for float32 inputs, and for bfloat16 under the
    interpreter (whose tl.dot does not handle bfloat16, see the module docstring)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


@functools.lru_cache(maxsize=256)
def _tiles(seg_starts: tuple[int, ...], seg_slots: tuple[int, ...], block_m: int,
           device: torch.device) -> torch.Tensor:
    """[tiles, 3] int32 (row0, row1, slot): the segments of a slot >= 0 cut into block_m rows.
    Cached: the engine calls every projection of every layer with the same segments."""
    rows = [(r, min(r + block_m, seg_starts[i + 1]), slot)
            for i, slot in enumerate(seg_slots) if slot >= 0
            for r in range(seg_starts[i], seg_starts[i + 1], block_m)]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 3).to(device)


@functools.lru_cache(maxsize=64)
def _scales_tensor(scales: tuple[float, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(scales, dtype=torch.float32).to(device)


def _check_dtypes(*tensors: torch.Tensor) -> None:
    dtype = tensors[0].dtype
    if dtype not in DTYPES:
        raise ValueError(f"LoRA kernels take {', '.join(map(str, DTYPES))}, got {dtype}")
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise ValueError(f"x and the LoRA weights must share a dtype, got {dtype} and {t.dtype}")
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")


def _slots_on(slot_per_token: torch.Tensor, num_slots: int, device: torch.device) -> torch.Tensor:
    """The per-token slots on the kernels' device; range-checked when they are on the host."""
    if slot_per_token.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_per_token must be int32 or int64, got {slot_per_token.dtype}")
    if slot_per_token.device.type == "cpu" and slot_per_token.numel():
        lo, hi = int(slot_per_token.min()), int(slot_per_token.max())
        if lo < -1 or hi >= num_slots:
            raise IndexError(f"slot_per_token must be in [-1, {num_slots}), got {lo}..{hi}")
    return slot_per_token.to(device, non_blocking=True)


def _check_segments(seg_starts: list[int], seg_slots: list[int], num_tokens: int, num_slots: int) -> None:
    if len(seg_starts) != len(seg_slots) + 1:
        raise ValueError("seg_starts must have one more entry than seg_slots")
    if seg_starts[0] < 0 or seg_starts[-1] > num_tokens or any(
            a > b for a, b in itertools.pairwise(seg_starts)):
        raise ValueError(f"seg_starts must rise from >= 0 to <= {num_tokens}, got {seg_starts}")
    bad = [s for s in seg_slots if not -1 <= s < num_slots]
    if bad:
        raise IndexError(f"seg_slots must be in [-1, {num_slots}), got {bad}")


# ------------------------------------------------------------------------------- BGMV
def bgmv_shrink_partial(x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
                        zero: bool = True) -> torch.Tensor:
    """The shrink's float32 partial sums [split_k, T, r_max] (`slots` already on x's device).
    Rows of tokens without an adapter are zero when `zero`, else left unwritten."""
    num_tokens, k = x.shape
    num_slots, r_max, _ = lora_a.shape
    block_r = _rank_block(r_max)
    block_k = _pow2(k, 16, max(32, 8192 // block_r) if not interpreting() else 256)
    r_blocks = triton.cdiv(r_max, block_r)
    split, per_split = _split_k(k, block_k, num_tokens * r_blocks)
    part = (torch.zeros if zero else torch.empty)(split, num_tokens, r_max, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or r_max == 0:
        return part
    _launch(_bgmv_shrink_kernel, (num_tokens, r_blocks, split),
            x, lora_a, slots, part, k, r_max, num_slots, per_split,
            x.stride(0), x.stride(1), *lora_a.stride(), *part.stride(),
            BLOCK_R=block_r, BLOCK_K=block_k)
    return part


def bgmv_expand_partial(part: torch.Tensor, out: torch.Tensor, lora_bt: torch.Tensor, slots: torch.Tensor,
                        scaling: torch.Tensor) -> None:
    """out[t] += scaling[slots[t]] * part[:, t].sum(0) @ lora_bt[slots[t]] for slots[t] >= 0;
    `out` is the target columns (a view is fine), `scaling` on the device."""
    num_tokens, n = out.shape
    num_slots, r_max, _ = lora_bt.shape
    if num_tokens == 0 or n == 0 or r_max == 0:
        return
    block_r = _rank_block(r_max)
    block_n = _pow2(n, 16, max(32, 8192 // block_r))
    _launch(_bgmv_expand_kernel, (num_tokens, triton.cdiv(n, block_n)),
            part, lora_bt, out, slots, scaling, n, r_max, num_slots, part.shape[0],
            *part.stride(), *lora_bt.stride(), out.stride(0), out.stride(1),
            BLOCK_R=block_r, BLOCK_N=block_n)


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, slot_per_token: torch.Tensor) -> torch.Tensor:
    """shrunk [T, r_max] float32: x[t] @ lora_a[slot[t]]^T, zero for tokens with slot -1."""
    _check_dtypes(x, lora_a)
    slots = _slots_on(slot_per_token, lora_a.shape[0], x.device)
    part = bgmv_shrink_partial(x, lora_a, slots)
    return part[0] if part.shape[0] == 1 else part.sum(0)


def bgmv_expand(shrunk: torch.Tensor, out: torch.Tensor, lora_bt: torch.Tensor, slot_per_token: torch.Tensor,
                scaling: torch.Tensor, out_slice: tuple[int, int] | None = None) -> torch.Tensor:
    """out[t, lo:hi] += scaling[s] * shrunk[t] @ lora_bt[s] for s = slot_per_token[t] >= 0, in
    place (lora_bt [slots, r_max, hi - lo]; pass lora_b.transpose(1, 2) for B as stored by
    PEFT). Returns `out`."""
    lo, hi = out_slice if out_slice is not None else (0, out.shape[1])
    slots = _slots_on(slot_per_token, lora_bt.shape[0], out.device)
    bgmv_expand_partial(shrunk.float().unsqueeze(0), out[:, lo:hi], lora_bt, slots,
                        scaling.to(out.device, torch.float32))
    return out


# ------------------------------------------------------------------------------- SGMV
def _sgmv_block_m(seg_starts: list[int], seg_slots: list[int]) -> int:
    """Rows per tile: 16 (tl.dot's least) unless the adapted segments are long."""
    lengths = [seg_starts[i + 1] - seg_starts[i] for i, s in enumerate(seg_slots) if s >= 0]
    mean = sum(lengths) / len(lengths) if lengths else 0
    return 64 if mean >= 128 and not interpreting() else 32 if mean >= 32 else 16


def sgmv_shrink_partial(x: torch.Tensor, lora_a: torch.Tensor, tiles: torch.Tensor, block_m: int,
                        zero: bool = True) -> torch.Tensor:
    """The shrink's float32 partial sums [split_k, T, r_max] over the given tiles."""
    num_tokens, k = x.shape
    _, r_max, _ = lora_a.shape
    block_r = _rank_block(r_max)
    block_k = _pow2(k, 16, 64 if not interpreting() else 128)
    r_blocks = triton.cdiv(r_max, block_r)
    num_tiles = tiles.shape[0]
    split, per_split = _split_k(k, block_k, num_tiles * r_blocks)
    part = (torch.zeros if zero else torch.empty)(split, num_tokens, r_max, dtype=torch.float32, device=x.device)
    if num_tiles == 0 or r_max == 0:
        return part
    _launch(_sgmv_shrink_kernel, (num_tiles, r_blocks, split),
            x, lora_a, tiles, part, k, r_max, per_split,
            x.stride(0), x.stride(1), *lora_a.stride(), *part.stride(),
            BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, DOT_F32=_dot_f32(x.dtype))
    return part


def _sgmv_expand_launch(part: torch.Tensor, out: torch.Tensor, lora_bt: torch.Tensor, tiles: torch.Tensor,
                        block_m: int, scales: torch.Tensor) -> None:
    num_tiles = tiles.shape[0]
    _, n = out.shape
    _, r_max, _ = lora_bt.shape
    if num_tiles == 0 or n == 0 or r_max == 0:
        return
    block_r = _rank_block(r_max)
    block_n = _pow2(n, 16, 128 if not interpreting() else 256)
    _launch(_sgmv_expand_kernel, (num_tiles, triton.cdiv(n, block_n)),
            part, lora_bt, out, tiles, scales, n, r_max, part.shape[0],
            *part.stride(), *lora_bt.stride(), out.stride(0), out.stride(1),
            BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_N=block_n, DOT_F32=_dot_f32(lora_bt.dtype))


def sgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, seg_starts: list[int], seg_slots: list[int]) -> torch.Tensor:
    """shrunk [T, r_max] float32: rows of segment i times lora_a[seg_slots[i]]^T; zero in
    segments of slot -1 and rows outside every segment."""
    _check_dtypes(x, lora_a)
    _check_segments(seg_starts, seg_slots, x.shape[0], lora_a.shape[0])
    block_m = _sgmv_block_m(seg_starts, seg_slots)
    tiles = _tiles(tuple(seg_starts), tuple(seg_slots), block_m, x.device)
    part = sgmv_shrink_partial(x, lora_a, tiles, block_m)
    return part[0] if part.shape[0] == 1 else part.sum(0)


def sgmv_expand(shrunk: torch.Tensor, out: torch.Tensor, lora_bt: torch.Tensor, seg_starts: list[int],
                seg_slots: list[int], scales: list[float], out_slice: tuple[int, int] | None = None) -> torch.Tensor:
    """out[rows of segment i, lo:hi] += scales[s] * shrunk[rows] @ lora_bt[s], s = seg_slots[i]
    >= 0, in place. Returns `out`."""
    lo, hi = out_slice if out_slice is not None else (0, out.shape[1])
    _check_segments(seg_starts, seg_slots, out.shape[0], lora_bt.shape[0])
    block_m = _sgmv_block_m(seg_starts, seg_slots)
    tiles = _tiles(tuple(seg_starts), tuple(seg_slots), block_m, out.device)
    _sgmv_expand_launch(shrunk.float().unsqueeze(0), out[:, lo:hi], lora_bt, tiles, block_m,
                        _scales_tensor(tuple(float(s) for s in scales), out.device))
    return out


# ------------------------------------------------------------------------------- LoRA-shaped
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, slot_per_token: torch.Tensor | None = None, *,
                segments: tuple[list[int], list[int]] | None = None) -> torch.Tensor:
    """shrunk [T, r_max] float32, per token (BGMV: `slot_per_token`) or per segment (SGMV:
    `segments=(seg_starts, seg_slots)`); rows without an adapter are zero."""
    if (slot_per_token is None) == (segments is None):
        raise ValueError("give exactly one of slot_per_token and segments")
    if slot_per_token is not None:
        return bgmv_shrink(x, lora_a, slot_per_token)
    assert segments is not None  # noqa: S101 - for mypy; checked above
    return sgmv_shrink(x, lora_a, *segments)


def lora_expand(shrunk: torch.Tensor, out: torch.Tensor, lora_bt: torch.Tensor,
                scaling: torch.Tensor | list[float], slot_per_token: torch.Tensor | None = None, *,
                segments: tuple[list[int], list[int]] | None = None,
                out_slice: tuple[int, int] | None = None) -> torch.Tensor:
    """Add scaling[s] * shrunk @ lora_bt[s] into out[:, lo:hi] in place, per token (BGMV) or
    per segment (SGMV), as `lora_shrink`. Returns `out`."""
    if (slot_per_token is None) == (segments is None):
        raise ValueError("give exactly one of slot_per_token and segments")
    if slot_per_token is not None:
        scale_t = scaling if isinstance(scaling, torch.Tensor) else torch.tensor(scaling, dtype=torch.float32)
        return bgmv_expand(shrunk, out, lora_bt, slot_per_token, scale_t, out_slice)
    assert segments is not None  # noqa: S101 - for mypy; checked above
    scales = scaling.tolist() if isinstance(scaling, torch.Tensor) else list(scaling)
    return sgmv_expand(shrunk, out, lora_bt, *segments, scales, out_slice)


# ------------------------------------------------------------------------------- the reference's signatures
def lora_shrink_expand(
    x: torch.Tensor,               # [T, in]
    out: torch.Tensor,             # [T, out_total], added to in place
    lora_a: torch.Tensor,          # [num_slots, r_max, in]
    lora_b: torch.Tensor,          # [num_slots, hi - lo, r_max]
    slot_per_token: torch.Tensor,  # [T] int64, -1 = no adapter
    scaling: torch.Tensor,         # [num_slots] float
    out_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """reference.lora_shrink_expand by BGMV: one shrink and one expand launch, no sort and no
    host sync (save the range check of host-side slots). Returns `out`."""
    lo, hi = check_shrink_expand_args(x, out, lora_a, lora_b, slot_per_token, scaling, out_slice)
    num_tokens, num_slots = x.shape[0], lora_a.shape[0]
    _check_dtypes(x, lora_a, lora_b)
    slots = _slots_on(slot_per_token, num_slots, x.device)
    if num_tokens == 0 or hi == lo:
        return out
    part = bgmv_shrink_partial(x, lora_a, slots, zero=False)   # the expand skips what is unwritten
    bgmv_expand_partial(part, out[:, lo:hi], lora_b.transpose(1, 2), slots, scaling.to(x.device, torch.float32))
    return out


def sgmv(
    x: torch.Tensor,               # [T, in]
    out: torch.Tensor,             # [T, out_total], added to in place
    lora_a: torch.Tensor,          # [num_slots, r_max, in]
    lora_bt: torch.Tensor,         # [num_slots, r_max, hi - lo]
    seg_starts: list[int],         # [S + 1] row offsets of contiguous segments
    seg_slots: list[int],          # [S] slot of each segment, -1 = no adapter
    scales: list[float],           # [num_slots]
    out_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """reference.sgmv by SGMV tiles: one shrink and one expand launch. Returns `out`."""
    lo, hi = out_slice if out_slice is not None else (0, out.shape[1])
    if x.dim() != 2 or out.dim() != 2 or out.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, in] and out [T, out_total], got {tuple(x.shape)} and {tuple(out.shape)}")
    if not 0 <= lo <= hi <= out.shape[1]:
        raise ValueError(f"out_slice {(lo, hi)} is outside out's {out.shape[1]} columns")
    num_slots, r_max, in_features = lora_a.shape
    if in_features != x.shape[1]:
        raise ValueError(f"lora_a takes {in_features} inputs, x has {x.shape[1]}")
    if tuple(lora_bt.shape) != (num_slots, r_max, hi - lo):
        raise ValueError(f"lora_bt must be {(num_slots, r_max, hi - lo)}, got {tuple(lora_bt.shape)}")
    if len(scales) != num_slots:
        raise ValueError(f"scales must have {num_slots} entries, got {len(scales)}")
    _check_dtypes(x, lora_a, lora_bt)
    _check_segments(seg_starts, seg_slots, x.shape[0], num_slots)
    if hi == lo or all(s < 0 for s in seg_slots):
        return out
    block_m = _sgmv_block_m(seg_starts, seg_slots)
    tiles = _tiles(tuple(seg_starts), tuple(seg_slots), block_m, x.device)
    part = sgmv_shrink_partial(x, lora_a, tiles, block_m, zero=False)
    _sgmv_expand_launch(part, out[:, lo:hi], lora_bt, tiles, block_m,
                        _scales_tensor(tuple(float(s) for s in scales), x.device))
    return out


__all__ = [
    "DTYPES", "bgmv_expand", "bgmv_shrink", "lora_expand", "lora_shrink", "lora_shrink_expand", "sgmv",
    "sgmv_expand", "sgmv_shrink",
]
