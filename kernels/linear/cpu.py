"""Dense projections on the CPU in float32 through a small C kernel (csrc/linear.c, built on
first use by kernels/cbuild.py), the weight packed once into panels of 32 output columns.
Why not oneDNN's packed linear (torch.ops.mkldnn._linear_pointwise): it spends a fixed cost
per call before any arithmetic (primitive lookup, descriptors) and a larger one the first time
it meets each new row count, and on a decode step's small shapes that overhead, not the
arithmetic, is most of its time; this kernel has no per-call setup and keeps up with oneDNN
on a prefill's large shapes. Results equal F.linear's within float32 rounding (the sums run
in another order, with FMAs).

A gated MLP's [gate; up] projection may be packed in pairs (`pairs_of=inter`): gate's and
up's panel i side by side, so that `linear_silu_mul` computes silu(gate) * up from the
registers (no [rows, 2 x inter] tensor, no separate SiLU-and-mul pass), and `linear` still
gives the plain product from the same packed copy.

`LOCKGATE_KERNELS=reference` keeps F.linear; `cpu` asks for this kernel and fails loudly
(naming what is missing) where it cannot be built; unset, it is taken where it builds, and
where it does not (no compiler) F.linear serves and the log says so once."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from lockgate.kernels.cbuild import CKernel

SOURCE = Path(__file__).with_name("csrc") / "linear.c"
PANEL = 32     # output columns per packed panel (csrc/linear.c's NR)


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lg_linear_pack_f32.argtypes = [ptr, i64, i64, ptr]
    lib.lg_linear_pack_f32.restype = None
    lib.lg_linear_pack_pairs_f32.argtypes = [ptr, i64, i64, ptr]
    lib.lg_linear_pack_pairs_f32.restype = None
    lib.lg_linear_f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, i64, ctypes.c_int]
    lib.lg_linear_f32.restype = None
    lib.lg_linear_silu_mul_f32.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.lg_linear_silu_mul_f32.restype = None


KERNEL = CKernel(SOURCE, "CPU linear kernel", _declare)


def available() -> bool:
    """Whether the kernel runs in this process (see kernels.cbuild.CKernel.available)."""
    return KERNEL.available()


def _panels(out_features: int, pairs_of: int) -> int:
    return 2 * -(-pairs_of // PANEL) if pairs_of else -(-out_features // PANEL)


def packed_numel(out_features: int, in_features: int, pairs_of: int = 0) -> int:
    """Elements of a packed weight: the output columns rounded up to whole panels (in pairs:
    each half on its own)."""
    return _panels(out_features, pairs_of) * PANEL * in_features


def pack(weight: torch.Tensor, pairs_of: int = 0) -> torch.Tensor:
    """The weight [out, in] (float32, CPU) packed as the kernel reads it: [panels, in, 32] (a
    copy: the dense weight stays as it is). `pairs_of` = inter: a [gate; up] weight of
    2 x inter rows packed in pairs (gate's panel i, then up's)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack: a float32 CPU weight [out, in], got {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    w = weight.detach().contiguous()
    n, k = w.shape
    if pairs_of and n != 2 * pairs_of:
        raise ValueError(f"pack: a [gate; up] weight of 2 x {pairs_of} rows, got {n}")
    out = torch.empty(_panels(n, pairs_of), k, PANEL)
    lib = KERNEL.load()
    if pairs_of:
        lib.lg_linear_pack_pairs_f32(w.data_ptr(), pairs_of, k, out.data_ptr())
    else:
        lib.lg_linear_pack_f32(w.data_ptr(), n, k, out.data_ptr())
    return out


def _fits(name: str, x: torch.Tensor, packed: torch.Tensor, out_features: int, pairs_of: int) -> None:
    rows, k = x.shape
    panels = packed.shape[0]
    if (packed.dim() != 3 or packed.shape[1] != k or packed.shape[2] != PANEL
            or (pairs_of and out_features != 2 * pairs_of) or panels != _panels(out_features, pairs_of)):
        raise ValueError(f"{name}: x [{rows}, {k}] does not fit a packed weight {tuple(packed.shape)} "
                         f"of {out_features} outputs" + (f" in pairs of {pairs_of}" if pairs_of else ""))


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           pairs_of: int = 0) -> torch.Tensor:
    """x [rows, in] (float32, contiguous) times a packed weight of `out_features` outputs
    (`pairs_of` as it was packed with), plus bias [out] (float32, contiguous) -> [rows, out]."""
    _fits("linear", x, packed, out_features, pairs_of)
    rows, k = x.shape
    y = torch.empty(rows, out_features)
    KERNEL.load().lg_linear_f32(x.data_ptr(), rows, k, packed.data_ptr(), out_features,
                                None if bias is None else bias.data_ptr(), y.data_ptr(), pairs_of,
                                torch.get_num_threads())
    return y


def linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) -> [rows, inter], of x [rows, in] (float32, contiguous)
    and a [gate; up] weight packed in pairs of `inter`; as the SiLU-and-mul of `linear`'s
    output, within float32 rounding."""
    _fits("linear_silu_mul", x, packed, 2 * inter, inter)
    rows, k = x.shape
    out = torch.empty(rows, inter)
    KERNEL.load().lg_linear_silu_mul_f32(x.data_ptr(), rows, k, packed.data_ptr(), inter, out.data_ptr(),
                                         torch.get_num_threads())
    return out


__all__ = ["PANEL", "available", "linear", "linear_silu_mul", "pack", "packed_numel"]
