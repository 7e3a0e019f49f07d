"""Dense projections on the CPU in float32 through a small C kernel (csrc/linear.c, built on
first use by kernels/cbuild.py), the weight packed once into panels of 32 output columns.
It replaced oneDNN's packed linear (torch.ops.mkldnn._linear_pointwise), which costs ~25 us
a call before any arithmetic and ~0.5-1 ms the first time it meets each new row count, on a
decode step's small shapes the larger part of its time. Measured on a 2-core AMD EPYC
(AVX-512), best of 5, the demo model's shapes (2026-12-03; oneDNN -> this kernel):
256x256 at 8 rows 32 -> 11 us, at 64 rows 71 -> 47 us; 1408x256 at 8 rows 51 -> 38 us, at 64
rows 258 -> 258 us; at 2048 rows 0.9-1.1x oneDNN. Results equal F.linear's within float32
rounding (the sums run in another order, with FMAs).

`LOCKGATE_KERNELS=reference` keeps F.linear; `cpu` asks for this kernel and fails loudly
(naming what is missing) where it cannot be built; unset, it is taken where it builds, and
where it does not (no compiler) F.linear serves and the log says so once."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels.cbuild import CKernel

SOURCE = Path(__file__).with_name("csrc") / "linear.c"
PANEL = 32     # output columns per packed panel (csrc/linear.c's NR)


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lg_linear_pack_f32.argtypes = [ptr, i64, i64, ptr]
    lib.lg_linear_pack_f32.restype = None
    lib.lg_linear_f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int]
    lib.lg_linear_f32.restype = None


KERNEL = CKernel(SOURCE, "CPU linear kernel", _declare)


def available() -> bool:
    """Whether the kernel runs in this process (see kernels.cbuild.CKernel.available)."""
    return KERNEL.available()


def packed_numel(out_features: int, in_features: int) -> int:
    """Elements of a packed weight: the output columns rounded up to whole panels."""
    return -(-out_features // PANEL) * PANEL * in_features


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] (float32, CPU) packed as the kernel reads it: [panels, in, 32]
    (a copy: the dense weight stays as it is)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack: a float32 CPU weight [out, in], got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    w = weight.detach().contiguous()
    n, k = w.shape
    out = torch.empty(-(-n // PANEL), k, PANEL)
    KERNEL.load().lg_linear_pack_f32(w.data_ptr(), n, k, out.data_ptr())
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [rows, in] (float32, contiguous) times a packed weight of `out_features` outputs, plus
    bias [out] (float32, contiguous) -> [rows, out]."""
    rows, k = x.shape
    if packed.shape[1] != k or packed.shape[0] * PANEL < out_features or out_features <= (packed.shape[0] - 1) * PANEL:
        raise ValueError(f"linear: x [{rows}, {k}] does not fit a packed weight {tuple(packed.shape)} "
                         f"of {out_features} outputs")
    y = torch.empty(rows, out_features)
    KERNEL.load().lg_linear_f32(x.data_ptr(), rows, k, packed.data_ptr(), out_features,
                                None if bias is None else bias.data_ptr(), y.data_ptr(),
                                torch.get_num_threads())
    return y


__all__ = ["PANEL", "available", "linear", "pack", "packed_numel"]
