"""Weight-only 4/8-bit quantization in plain torch: unpack, dequantize, matmul. The reference
any fused device kernel is checked against, and the CPU path.

Both formats store integer codes q in [0, 2^bits) packed into int32 words, lowest bits first
(the code of element j of a word sits at bits [j * bits, (j + 1) * bits)), plus per group of
`group_size` input channels a scale s and an integer zero point z per output channel:

    W[i, o] = (q[i, o] - z[group(i), o]) * s[group(i), o]

Every function here returns W as [in, out] (the layout both formats pack, so y = x @ W);
`.T` gives the [out, in] of nn.Linear.

AutoAWQ, GEMM version (4-bit only):
    qweight int32 [in, out / 8]       packed along the *output* dimension
    qzeros  int32 [groups, out / 8]   packed the same way
    scales  fp16  [groups, out]
    group(i) = i // group_size
  Within a word the eight output columns are interleaved: nibble j holds column
  AWQ_PACK_ORDER[j] of the word's block of 8, i.e. nibbles 0..7 hold columns 0,2,4,6,1,3,5,7.

AutoGPTQ / GPTQModel, checkpoint format "gptq" (v1), 4 or 8 bits (pack = 32 / bits):
    qweight int32 [in / pack, out]       packed along the *input* dimension, in order
    qzeros  int32 [groups, out / pack]   packed along the output dimension, in order
    scales  fp16  [groups, out]
    g_idx   int32 [in]                   group of each input channel (any order: desc_act)
  v1 stores each zero point minus one: z = (stored & mask) + 1, read as the reference CUDA
  kernels read it. A real zero of 0 is therefore not representable (it would be stored as
  -1, whose sign bits spill into the neighbours); writers must avoid it.
"""

from __future__ import annotations

import torch

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # nibble j of a word holds column AWQ_PACK_ORDER[j]
GPTQ_BITS = (4, 8)


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32, device=device)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes packed `32 // bits` to an int32 along `dim`, lowest bits first -> int32 codes with
    that dimension `32 // bits` times longer (element k * pack + j from bits j * bits of k)."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed tensor must be int32, got {packed.dtype}")
    dim = dim % packed.dim()
    moved = packed.movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> _shifts(bits, packed.device)) & ((1 << bits) - 1)
    return codes.flatten(-2).movedim(-1, dim)


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `unpack_int32`: codes in [0, 2^bits) -> int32 words along `dim` (its size a
    multiple of 32 // bits). Values are masked to `bits`, so no code spills into another."""
    pack = 32 // bits
    dim = dim % codes.dim()
    moved = codes.to(torch.int64).movedim(dim, -1)
    if moved.shape[-1] % pack:
        raise ValueError(f"dimension {dim} of size {moved.shape[-1]} is not a multiple of {pack}")
    moved = (moved & ((1 << bits) - 1)).unflatten(-1, (-1, pack))
    words = (moved << _shifts(bits, codes.device).to(torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)   # two's complement int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def _awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """[rows, out] codes in AWQ nibble order -> natural column order."""
    order = torch.tensor(AWQ_PACK_ORDER, device=codes.device)
    blocks = codes.unflatten(-1, (-1, 8))
    out = torch.empty_like(blocks)
    out[..., order] = blocks
    return out.flatten(-2)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """[rows, out] 4-bit codes in natural column order -> int32 [rows, out / 8] in AWQ order."""
    order = torch.tensor(AWQ_PACK_ORDER, device=codes.device)
    interleaved = codes.unflatten(-1, (-1, 8))[..., order].flatten(-2)
    return pack_int32(interleaved, 4, dim=-1)


def awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, out / 8] in AWQ order -> int32 codes [rows, out] in natural order."""
    return _awq_columns(unpack_int32(packed, 4, dim=-1))


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """AutoAWQ GEMM tensors -> W [in, out] in scales' dtype."""
    codes = awq_unpack(qweight)
    zeros = awq_unpack(qzeros).repeat_interleave(group_size, dim=0)
    return (codes - zeros).to(scales.dtype) * scales.repeat_interleave(group_size, dim=0)


def gptq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor, bits: int
) -> torch.Tensor:
    """GPTQ v1 tensors -> W [in, out] in scales' dtype; row i uses group g_idx[i]."""
    if bits not in GPTQ_BITS:
        raise ValueError(f"bits must be one of {GPTQ_BITS}, got {bits}")
    codes = unpack_int32(qweight, bits, dim=0)
    zeros = unpack_int32(qzeros, bits, dim=1) + 1          # v1: stored zero = zero - 1
    groups = g_idx.long()
    return (codes - zeros[groups]).to(scales.dtype) * scales[groups]


def quant_matmul(x: torch.Tensor, weight_in_out: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W (+ bias) in x's dtype, W being [in, out] from one of the dequantizers."""
    y = x @ weight_in_out.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


def awq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize-then-matmul for AutoAWQ GEMM tensors (the weight is not kept)."""
    return quant_matmul(x, awq_dequantize(qweight, qzeros, scales, group_size), bias)


def gptq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize-then-matmul for GPTQ v1 tensors (the weight is not kept)."""
    return quant_matmul(x, gptq_dequantize(qweight, qzeros, scales, g_idx, bits), bias)
