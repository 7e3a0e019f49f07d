"""Bench cases for the W4A16 GEMM (kernels/quant/triton.py): AWQ and GPTQ 4-bit, group 128,
on a 7B-shaped projection (K=4096 into N=4096 or N=11008) at M = 1, 16 and 64 rows.

The GPU target: at M up to 16 the fused kernel at least 2x faster than `torch.matmul`
in the activation dtype on the already dequantized weight, so that is each case's `reference`
(the dequantization itself is done once, outside the timed call). M <= 16 is judged against
memory bandwidth (the packed weight dominates what must be read), M = 64 against compute.
`quick` gives tiny shapes that run in seconds under Triton's interpreter (a smoke test).
"""

from __future__ import annotations

import torch

from lockgate.kernels.benchcase import BenchCase
from lockgate.kernels.quant.reference import awq_dequantize, awq_pack, gptq_dequantize, pack_int32

GROUP = 128
BITS = 4


def _packed(
    method: str, K: int, N: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, ...]:
    """Random 4-bit tensors of one format, on `device`: (qweight, qzeros, scales[, g_idx])."""
    g = torch.Generator().manual_seed(seed)
    groups = K // GROUP
    codes = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 15, (groups, N), generator=g, dtype=torch.int32)
    scales = (torch.rand(groups, N, generator=g) * 0.01 + 0.001).to(dtype)
    tensors: tuple[torch.Tensor, ...]
    if method == "awq":
        tensors = (awq_pack(codes), awq_pack(zeros), scales)
    else:
        g_idx = torch.arange(K, dtype=torch.int32) // GROUP
        tensors = (pack_int32(codes, BITS, 0), pack_int32(zeros, BITS, 1), scales, g_idx)
    return tuple(t.to(device) for t in tensors)


def _case(method: str, M: int, K: int, N: int, dtype: torch.dtype, device: torch.device) -> BenchCase:
    from lockgate.kernels.quant import triton as fused  # triton is an optional dependency

    tensors = _packed(method, K, N, dtype, device, seed=M * 7 + N)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M), dtype=torch.float32).to(device, dtype)
    qweight, qzeros, scales = tensors[:3]
    if method == "awq":
        weight = awq_dequantize(qweight, qzeros, scales, GROUP).to(dtype)

        def run() -> torch.Tensor:
            return fused.awq_matmul(x, qweight, qzeros, scales, GROUP)
    else:
        g_idx = tensors[3]
        weight = gptq_dequantize(qweight, qzeros, scales, g_idx, BITS).to(dtype)

        def run() -> torch.Tensor:
            return fused.gptq_matmul(x, qweight, qzeros, scales, g_idx, BITS)

    def reference() -> torch.Tensor:
        return torch.matmul(x, weight)

    elt = x.element_size()
    bytes_moved = sum(t.numel() * t.element_size() for t in tensors) + (M * K + M * N) * elt
    name = f"{method} m{M} k{K} n{N} g{GROUP} {str(dtype).removeprefix('torch.')}"
    return BenchCase(
        kernel="w4a16", name=name, bound="memory" if M <= 16 else "compute",
        bytes_moved=bytes_moved, flops=2 * M * N * K, triton=run, reference=reference,
        baseline="torch.matmul on the dequantized weight",
    )


def cases(device: torch.device, dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    """AWQ and GPTQ W4A16 at M in (1, 16, 64) for K=4096 into N in (4096, 11008), group 128;
    quick: M in (1, 64) at K=256, N=128 (an interpreter smoke)."""
    ms, shapes = ((1, 64), [(256, 128)]) if quick else ((1, 16, 64), [(4096, 4096), (4096, 11008)])
    return [_case(method, M, K, N, dtype, device)
            for K, N in shapes for M in ms for method in ("awq", "gptq")]


__all__ = ["cases"]
