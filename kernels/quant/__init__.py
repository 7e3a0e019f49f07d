"""Weight-only quantized matmul (AutoAWQ GEMM, GPTQ v1): `awq_matmul` / `gptq_matmul` take
the path kernels.dispatch.pick chooses: the fused Triton W4A16 kernel (kernels/quant/triton.py,
dequantizing in registers) on CUDA, or under TRITON_INTERPRET=1 when LOCKGATE_KERNELS=triton;
else the plain-torch dequantize-then-matmul reference (kernels/quant/reference.py), which is
also the CPU path (there is no CPU kernel). Both paths have the same signatures."""

from __future__ import annotations

import torch

from lockgate.kernels.dispatch import pick
from lockgate.kernels.quant import reference
from lockgate.kernels.quant.reference import (
    AWQ_PACK_ORDER,
    awq_dequantize,
    awq_pack,
    awq_unpack,
    gptq_dequantize,
    pack_int32,
    quant_matmul,
    unpack_int32,
)


def awq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    group_size: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W (+ bias) in x's dtype for AutoAWQ GEMM tensors (see reference.awq_matmul)."""
    if pick(x.device) == "triton":
        from lockgate.kernels.quant import triton as fused  # triton is an optional dependency

        return fused.awq_matmul(x, qweight, qzeros, scales, group_size, bias)
    return reference.awq_matmul(x, qweight, qzeros, scales, group_size, bias)


def gptq_matmul(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
    g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W (+ bias) in x's dtype for GPTQ v1 tensors (see reference.gptq_matmul)."""
    if pick(x.device) == "triton":
        from lockgate.kernels.quant import triton as fused  # triton is an optional dependency

        return fused.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, bias)
    return reference.gptq_matmul(x, qweight, qzeros, scales, g_idx, bits, bias)


__all__ = [
    "AWQ_PACK_ORDER",
    "awq_dequantize",
    "awq_matmul",
    "awq_pack",
    "awq_unpack",
    "gptq_dequantize",
    "gptq_matmul",
    "pack_int32",
    "quant_matmul",
    "reference",
    "unpack_int32",
]
