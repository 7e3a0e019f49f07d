"""oneDNN's fp32 matmul with the weight packed once into its blocked layout (the op torch's
own compiler uses for frozen CPU linears: mkldnn._linear_pointwise). Measured on a 2-core
AMD EPYC (AVX-512) against F.linear (MKL, which runs its AVX2 code there), the small demo
model's shapes: 2.0-2.5x from 32 rows up, 1.5-3.5x at 8 rows, 1.8-2.4x at 2048 rows
(2026-12-03). Results equal F.linear's within float32 rounding."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MIN_ROWS = 8
MIN_WEIGHT_NUMEL = 1 << 20


@functools.cache
def available() -> bool:
    """oneDNN is built into this torch and its packed linear runs and agrees with F.linear."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(9, 24, generator=g), torch.randn(40, 24, generator=g)
        b = torch.randn(40, generator=g)
        got = linear(x, pack(w), b)
    except RuntimeError:
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's layout (a copy: the dense weight stays as it is)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] contiguous float32 -> [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
