"""Dense projections, y = x W^T (+ b). `linear` picks per call with kernels.dispatch.pick:
on the CPU in float32 a C kernel with the weight packed once (`cpu.py`; faster than MKL's
sgemm and oneDNN's packed linear on a decode step's small shapes, and about even with
oneDNN on a prefill's), else `F.linear` (the reference, which every device runs).
`LOCKGATE_KERNELS=reference` keeps `F.linear`."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from lockgate.kernels.dispatch import cpu_kernel_runs, pick
from lockgate.kernels.linear import cpu


class PackedWeight:
    """A projection's weight as the CPU kernel wants it, packed on first use and again whenever the
    weight is replaced (another tensor, or another storage) or changed in place (its version
    moves).

    Used from one thread at a time (the engine's step loop; each model owns its modules).
    `implementation` never packs an inference tensor, whose in-place changes have no version
    to show them. `pairs_of` = inter: a gated MLP's [gate; up] weight, packed in pairs so that
    `gate_up_silu_mul` can take it too (cpu.pack)."""

    __slots__ = ("_key", "_source", "packed", "pairs_of")

    def __init__(self, pairs_of: int = 0) -> None:
        self._key: tuple[int, int, tuple[int, ...]] | None = None
        self._source: weakref.ref[torch.Tensor] | None = None   # the very tensor packed
        self.packed: torch.Tensor | None = None
        self.pairs_of = pairs_of

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self._key or self.packed is None or self._source is None or self._source() is not weight:
            packed = cpu.pack(weight, self.pairs_of)
            self._key, self._source, self.packed = key, weakref.ref(weight), packed
            return packed
        return self.packed

    def clear(self) -> None:
        self._key, self.packed = None, None


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections of this device and dtype get a packed copy of their weight (memory
    the budget counts beside the weights)."""
    return (device.type == "cpu" and dtype == torch.float32
            and pick(device, has_cpu_kernel=cpu.available()) == "cpu")


def implementation(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> str:
    """"cpu" (the C kernel, packed weight) or "reference" (F.linear) for this call."""
    f32 = torch.float32     # attribute checks only: this runs on every projection
    fits = (x.dtype is f32 and weight.dtype is f32 and x.is_cpu and weight.is_cpu
            and weight.dim() == 2 and x.dim() == 2 and x.shape[0] > 0 and x.shape[1] > 0
            and not weight.is_inference()
            and (bias is None or (bias.dtype is f32 and bias.is_cpu))
            # the kernel has no backward: where a gradient is wanted, F.linear
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))
    return "cpu" if fits and cpu_kernel_runs(cpu.available) else "reference"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight) -> torch.Tensor:
    """F.linear(x, weight, bias), through the C kernel on the CPU in float32 (same result
    within float32 rounding: the sums run in another order)."""
    if implementation(x, weight, bias) == "cpu":
        return cpu.linear(x.contiguous(), packed.get(weight), None if bias is None else bias.contiguous(),
                          weight.shape[0], packed.pairs_of)
    return F.linear(x, weight, bias)


def gate_up_silu_mul(x: torch.Tensor, weight: torch.Tensor, packed: PackedWeight) -> torch.Tensor | None:
    """silu(gate) * up of x's [gate; up] projection (weight [2 x inter, in], no bias) in one
    pass of the C kernel, where `linear` would take it and `packed` is in pairs of inter;
    None otherwise (the caller projects, then applies the activation)."""
    if not packed.pairs_of or implementation(x, weight) != "cpu":
        return None
    return cpu.linear_silu_mul(x.contiguous(), packed.get(weight), packed.pairs_of)


__all__ = ["PackedWeight", "gate_up_silu_mul", "implementation", "linear", "packs"]
