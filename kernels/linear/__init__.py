"""Dense projections, y = x W^T (+ b). `linear` picks per call with kernels.dispatch.pick:
on the CPU in float32 oneDNN with the weight packed once (`cpu.py`; about 2x MKL's sgemm
on machines where MKL keeps to AVX2 and oneDNN uses AVX-512), else `F.linear` (the
reference, which every device runs). `LOCKGATE_KERNELS=reference` keeps `F.linear`."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kernels.dispatch import pick
from kernels.linear import cpu


class PackedWeight:
    """A projection's weight as oneDNN wants it, packed on first use and again whenever the
    weight is replaced (another tensor, or another storage) or changed in place (its version
    moves).

    Used from one thread at a time (the engine's step loop; each model owns its modules).
    `implementation` never packs an inference tensor, whose in-place changes have no version
    to show them."""

    __slots__ = ("_key", "_source", "packed")

    def __init__(self) -> None:
        self._key: tuple[int, int, tuple[int, ...]] | None = None
        self._source: weakref.ref[torch.Tensor] | None = None   # the very tensor packed
        self.packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version, tuple(weight.shape))
        if key != self._key or self.packed is None or self._source is None or self._source() is not weight:
            packed = cpu.pack(weight)
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
    """"cpu" (oneDNN, packed weight) or "reference" (F.linear) for this call."""
    fits = (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and x.dim() == 2 and not weight.is_inference()
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"))
            # oneDNN's op has no backward: where a gradient is wanted, F.linear
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                                  or (bias is not None and bias.requires_grad))))
    if not fits or pick(x.device, has_cpu_kernel=cpu.available()) != "cpu":
        return "reference"
    # oneDNN's fixed cost (~10 us) loses to MKL's gemv on one or a few rows of a small
    # weight; from 8 rows, or on a large weight (a vocabulary head), it wins
    return "cpu" if x.shape[0] >= cpu.MIN_ROWS or weight.numel() >= cpu.MIN_WEIGHT_NUMEL else "reference"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN on the CPU in float32 (same result within
    float32 rounding: the sums run in another order)."""
    if implementation(x, weight, bias) == "cpu":
        return cpu.linear(x.contiguous(), packed.get(weight), None if bias is None else bias.contiguous())
    return F.linear(x, weight, bias)


__all__ = ["PackedWeight", "implementation", "linear", "packs"]
