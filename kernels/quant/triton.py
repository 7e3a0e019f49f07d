"""W4A16 (and GPTQ W8A16) GEMM in Triton: y = x @ W (+ bias) with W given as packed AutoAWQ
GEMM or GPTQ v1 tensors, dequantized tile by tile in registers and never written out.

Same signatures, layouts and output dtype as kernels/quant/reference.py (read its docstring
for the formats). Each program owns a BLOCK_M x BLOCK_N tile of y and walks its share of K
in BLOCK_K steps: it loads the packed int32 words of the weight tile, splits them into codes
with shifts and masks, subtracts the group's zero point and multiplies by its scale (exact in
fp32), rounds that to the scales' dtype (so the dequantized tile equals the reference's W bit
for bit), casts it to x's dtype and feeds `tl.dot`, which accumulates in fp32.

  AWQ:  codes packed 8 to a word along N in AWQ's interleaved order; a K tile never straddles
        a group when BLOCK_K divides group_size (the usual case: one zero/scale row per tile),
        otherwise the group is looked up per input row.
  GPTQ: codes packed 32 / bits to a word along K, in order; every input row k reads the zero
        point (stored minus one, v1) and scale of group g_idx[k], so act-order (a shuffled
        g_idx) costs nothing extra over a sorted one.

Small M (decode) leaves few tiles to spread over the device's SMs; there K is split over
several programs writing fp32 partial sums that a torch sum adds up in a fixed order (so the
result is deterministic). Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors) K is
not split unless asked, to keep the number of programs low.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lockgate.kernels.dispatch import interpreting, on_device
from lockgate.kernels.quant.reference import GPTQ_BITS

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _finish(acc, x_ptr, b_ptr, y_ptr, pid_k, offs_m, offs_n, M, N, stride_ys, stride_ym, stride_yn,
            HAS_BIAS: tl.constexpr):
    """Add the bias (rounded to x's dtype, as the reference adds it; only split 0 adds it) and
    store the tile of y, or of split pid_k's fp32 partial sums."""
    n_mask = offs_n < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    y_ptrs = y_ptr + pid_k * stride_ys + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & n_mask[None, :])


@triton.jit
def _mma(acc, x, w, s_ptr, x_ptr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """acc += x @ w, w being the dequantized tile in fp32 (the exact product (q - z) * s):
    rounded to the scales' dtype (the reference's W), then to x's dtype, fed to tl.dot.
    DOT_IN_FP32: the interpreter's tl.dot multiplies bfloat16 bit patterns as integers
    (triton-lang/triton#11584), so there the (exactly representable) operands go up to fp32."""
    w = w.to(s_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty)
    if DOT_IN_FP32:
        return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(x, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _awq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K, group_size, k_per_split,
    stride_xm, stride_xk, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn,
    stride_ys, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, TILE_GROUP: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    WORDS_N: tl.constexpr = BLOCK_N // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = pid_n * WORDS_N + tl.arange(0, WORDS_N)          # packed words along N
    m_mask = offs_m < M
    rows_x = offs_m.to(tl.int64) * stride_xm                    # int64: M * K may pass 2^31
    n_mask = offs_n < N
    w_mask = offs_w < N // 8
    # column p of a block of 8 sits in nibble p // 2 + 4 * (p % 2) (AWQ_PACK_ORDER inverted)
    p = tl.arange(0, 8)
    shifts = ((p // 2) + (p % 2) * 4) * 4

    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + rows_x[:, None] + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        words = tl.load(qw_ptr + offs_k[:, None] * stride_qwk + offs_w[None, :] * stride_qwn,
                        mask=k_mask[:, None] & w_mask[None, :], other=0)
        q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        if TILE_GROUP:   # the whole tile is in group k0 // group_size: one zero/scale row
            g = k0 // group_size
            zwords = tl.load(qz_ptr + g * stride_qzg + offs_w * stride_qzn, mask=w_mask, other=0)
            z = tl.reshape((zwords[:, None] >> shifts[None, :]) & 0xF, (BLOCK_N,))
            s = tl.load(s_ptr + g * stride_sg + offs_n * stride_sn, mask=n_mask, other=0.0)
            w = (q - z[None, :]).to(tl.float32) * s.to(tl.float32)[None, :]
        else:            # the group of each input row
            gk = offs_k // group_size
            kn_mask = k_mask[:, None] & n_mask[None, :]
            zwords = tl.load(qz_ptr + gk[:, None] * stride_qzg + offs_w[None, :] * stride_qzn,
                             mask=k_mask[:, None] & w_mask[None, :], other=0)
            z = tl.reshape((zwords[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
            s = tl.load(s_ptr + gk[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=kn_mask, other=0.0)
            w = (q - z).to(tl.float32) * s.to(tl.float32)
        acc = _mma(acc, x, w, s_ptr, x_ptr, DOT_PRECISION, DOT_IN_FP32)
    _finish(acc, x_ptr, b_ptr, y_ptr, pid_k, offs_m, offs_n, M, N, stride_ys, stride_ym, stride_yn, HAS_BIAS)


@triton.jit
def _gptq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, b_ptr, y_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xk, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn,
    stride_ys, stride_ym, stride_yn,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS_K: tl.constexpr = BLOCK_K // PACK
    WORDS_N: tl.constexpr = BLOCK_N // PACK
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_zw = pid_n * WORDS_N + tl.arange(0, WORDS_N)          # zero-point words along N
    m_mask = offs_m < M
    rows_x = offs_m.to(tl.int64) * stride_xm                    # int64: M * K may pass 2^31
    n_mask = offs_n < N
    zw_mask = offs_zw < N // PACK
    shifts = tl.arange(0, PACK) * BITS                         # element j of a word: bits j * BITS

    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        offs_kw = k0 // PACK + tl.arange(0, WORDS_K)           # weight words along K
        k_mask = offs_k < k_end
        kw_mask = offs_kw < k_end // PACK
        x = tl.load(x_ptr + rows_x[:, None] + offs_k[None, :] * stride_xk,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        words = tl.load(qw_ptr + offs_kw[:, None] * stride_qwk + offs_n[None, :] * stride_qwn,
                        mask=kw_mask[:, None] & n_mask[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
        gk = tl.load(g_ptr + offs_k, mask=k_mask, other=0)    # group of each input row
        zwords = tl.load(qz_ptr + gk[:, None] * stride_qzg + offs_zw[None, :] * stride_qzn,
                         mask=k_mask[:, None] & zw_mask[None, :], other=0)
        z = tl.reshape((zwords[:, :, None] >> shifts[None, None, :]) & MASK, (BLOCK_K, BLOCK_N)) + 1
        s = tl.load(s_ptr + gk[:, None] * stride_sg + offs_n[None, :] * stride_sn,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        w = (q - z).to(tl.float32) * s.to(tl.float32)
        acc = _mma(acc, x, w, s_ptr, x_ptr, DOT_PRECISION, DOT_IN_FP32)
    _finish(acc, x_ptr, b_ptr, y_ptr, pid_k, offs_m, offs_n, M, N, stride_ys, stride_ym, stride_yn, HAS_BIAS)


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two dividing n, at most cap."""
    d = 1
    while d < cap and n % (2 * d) == 0:
        d *= 2
    return d


def _split_k(device: torch.device, tiles: int, k_steps: int) -> int:
    """How many programs share K: enough tiles for about two waves over the SMs, at least two
    K steps per program. 1 off CUDA (the interpreter: fewest programs)."""
    if device.type != "cuda" or interpreting():
        return 1
    return max(1, min(2 * _sm_count(device.index) // max(tiles, 1), k_steps // 2, 16))


@functools.cache
def _sm_count(index: int | None) -> int:
    return int(torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
               .multi_processor_count)


def choose_tiles(device: torch.device, M: int, N: int, K: int, block_k: int) -> Tiles:
    """Tile sizes for an M x N x K product (block_k already fitted to the format)."""
    if M <= 16:
        bm, bn, warps = 16, 64, 4
    elif M <= 64:
        bm, bn, warps = (32 if M <= 32 else 64), 64, 4
    else:
        bm, bn, warps = 64, 128, 8
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    return Tiles(bm, bn, block_k, _split_k(device, tiles, triton.cdiv(K, block_k)), warps)


def _check_x(x: torch.Tensor, K: int) -> torch.Tensor:
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x must be one of {SUPPORTED_DTYPES}, got {x.dtype}")
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight {K}")
    return x.reshape(-1, K)


def _launch(kernel, x2: torch.Tensor, out_shape: tuple[int, ...], N: int, K: int, tiles: Tiles,
            tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None, scalars: tuple[int, ...],
            strides: tuple[int, ...], **constexprs) -> torch.Tensor:
    """Run `kernel` over the tiles of y [M, N] (fp32 partials when K is split) and return y
    in x's dtype, shaped out_shape."""
    M = x2.shape[0]
    y_final = x2.new_empty((M, N))
    if M == 0 or N == 0:
        return y_final.reshape(out_shape)
    if K == 0:
        y_final.zero_()
        if bias is not None:
            y_final += bias.to(x2.dtype)
        return y_final.reshape(out_shape)
    split = max(1, min(tiles.split_k, triton.cdiv(K, tiles.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), tiles.block_k) * tiles.block_k
    split = triton.cdiv(K, k_per_split)
    if split == 1:
        y = y_final
        stride_ys = 0
    else:
        y = torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
        stride_ys = y.stride(0)
    grid = (triton.cdiv(M, tiles.block_m) * triton.cdiv(N, tiles.block_n), split)
    with on_device(x2.device):
        kernel[grid](
            x2, *tensors, bias if bias is not None else y, y,
            M, N, K, *scalars, k_per_split,
            x2.stride(0), x2.stride(1), *strides,
            stride_ys, y.stride(-2), y.stride(-1),
            HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
            DOT_IN_FP32=interpreting() and x2.dtype == torch.bfloat16,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            **constexprs,
        )
    if split > 1:
        y_final.copy_(y.sum(dim=0))
    return y_final.reshape(out_shape)


def awq_launch(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, bias: torch.Tensor | None = None, tiles: Tiles | None = None,
) -> torch.Tensor:
    """`awq_matmul` with the tiles chosen by the caller (tests, tuning) or by `choose_tiles`."""
    K, N = qweight.shape[0], qweight.shape[1] * 8
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("qweight and qzeros must be int32")
    if group_size <= 0 or K % group_size:
        raise ValueError(f"group_size {group_size} must be positive and divide in_features {K}")
    groups = K // group_size
    if tuple(qzeros.shape) != (groups, N // 8) or tuple(scales.shape) != (groups, N):
        raise ValueError(
            f"AWQ: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not fit qweight "
            f"{tuple(qweight.shape)} with group_size {group_size} (want {(groups, N // 8)} / {(groups, N)})"
        )
    x2 = _check_x(x, K)
    # BLOCK_K dividing group_size keeps every K tile inside one group
    fit = _pow2_divisor(group_size, 128 if x2.shape[0] <= 16 else 64)
    tile_group = fit >= 16
    if tiles is None:
        tiles = choose_tiles(x.device, x2.shape[0], N, K, fit if tile_group else 64)
    tile_group = tile_group and group_size % tiles.block_k == 0
    return _launch(
        _awq_kernel, x2, (*x.shape[:-1], N), N, K, tiles, (qweight, qzeros, scales), bias,
        (group_size,), (*qweight.stride(), *qzeros.stride(), *scales.stride()),
        TILE_GROUP=tile_group,
    )


def gptq_launch(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None, tiles: Tiles | None = None,
) -> torch.Tensor:
    """`gptq_matmul` with the tiles chosen by the caller (tests, tuning) or by `choose_tiles`."""
    if bits not in GPTQ_BITS:
        raise ValueError(f"bits must be one of {GPTQ_BITS}, got {bits}")
    pack = 32 // bits
    K, N = qweight.shape[0] * pack, qweight.shape[1]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("qweight and qzeros must be int32")
    if N % pack or qzeros.shape[1] != N // pack or tuple(scales.shape) != (qzeros.shape[0], N):
        raise ValueError(
            f"GPTQ {bits}-bit: qzeros {tuple(qzeros.shape)} / scales {tuple(scales.shape)} do not fit "
            f"qweight {tuple(qweight.shape)}"
        )
    if tuple(g_idx.shape) != (K,):
        raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({K},)")
    if g_idx.dtype != torch.int32 or g_idx.stride(0) != 1:
        g_idx = g_idx.to(torch.int32).contiguous()
    x2 = _check_x(x, K)
    if tiles is None:
        tiles = choose_tiles(x.device, x2.shape[0], N, K, 128 if x2.shape[0] <= 16 else 64)
    if tiles.block_k % pack or tiles.block_n % pack:
        raise ValueError(f"block_k and block_n must be multiples of {pack}")
    return _launch(
        _gptq_kernel, x2, (*x.shape[:-1], N), N, K, tiles, (qweight, qzeros, scales, g_idx), bias,
        (), (*qweight.stride(), *qzeros.stride(), *scales.stride()),
        BITS=bits,
    )


def awq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W (+ bias) in x's dtype for AutoAWQ GEMM tensors, W dequantized in registers."""
    return awq_launch(x, qweight, qzeros, scales, group_size, bias)


def gptq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W (+ bias) in x's dtype for GPTQ v1 tensors, W dequantized in registers."""
    return gptq_launch(x, qweight, qzeros, scales, g_idx, bits, bias)


__all__ = ["SUPPORTED_DTYPES", "Tiles", "awq_launch", "awq_matmul", "choose_tiles", "gptq_launch", "gptq_matmul"]
