"""Dense projections, y = x W^T (+ b). `linear` picks per call with kernels.dispatch.pick:
on the CPU in float32 oneDNN with the weight packed once (`cpu.py`; about 2x MKL's sgemm
on machines where MKL keeps to AVX2 and oneDNN uses AVX-512), else `F.linear` (the
reference, which every device runs). `LOCKGATE_KERNELS=reference` keeps `F.linear`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.dispatch import pick
from kernels.linear import cpu


class PackedWeight:
    """A projection's weight as oneDNN wants it, packed on first use and again whenever the
    weight is replaced or changed in place (its storage or version moves)."""

    __slots__ = ("_key", "packed")

    def __init__(self) -> None:
        self._key: tuple[int, int, tuple[int, ...]] | None = None
        self.packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        try:
            version = weight._version
        except RuntimeError:    # an inference tensor keeps no version: it cannot change in place either
            version = -1
        key = (weight.data_ptr(), version, tuple(weight.shape))
        if key != self._key or self.packed is None:
            self.packed = cpu.pack(weight)
            self._key = key
        return self.packed

    def clear(self) -> None:
        self._key, self.packed = None, None


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether projections of this device and dtype get a packed copy of their weight (memory
    the budget counts beside the weights)."""
    return (device.type == "cpu" and dtype == torch.float32
            and pick(device, has_cpu_kernel=cpu.available()) == "cpu")


def implementation(x: torch.Tensor, weight: torch.Tensor) -> str:
    """"cpu" (oneDNN, packed weight) or "reference" (F.linear) for this call."""
    fits = (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 2 and x.dim() == 2)
    if not fits or pick(x.device, has_cpu_kernel=cpu.available()) != "cpu":
        return "reference"
    # oneDNN's fixed cost (~10 us) loses to MKL's gemv on one or a few rows of a small
    # weight; from 8 rows, or on a large weight (a vocabulary head), it wins
    return "cpu" if x.shape[0] >= cpu.MIN_ROWS or weight.numel() >= cpu.MIN_WEIGHT_NUMEL else "reference"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight) -> torch.Tensor:
    """F.linear(x, weight, bias), through oneDNN on the CPU in float32 (same result within
    float32 rounding: the sums run in another order)."""
    if implementation(x, weight) == "cpu":
        return cpu.linear(x.contiguous(), packed.get(weight), bias)
    return F.linear(x, weight, bias)


__all__ = ["PackedWeight", "implementation", "linear", "packs"]
