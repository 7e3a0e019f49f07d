"""Multi-LoRA. `sgmv` and `lora_shrink_expand` pick their implementation per call with
kernels.dispatch.pick(x.device): the Triton kernels (`triton.py`: SGMV tiles for segments,
BGMV per token) on CUDA, or anywhere under LOCKGATE_KERNELS=triton with TRITON_INTERPRET=1;
else the plain-torch reference (`reference.py`), which is also the CPU path (there is no
CPU kernel) and what the Triton kernels are checked against. triton is imported only when
that path is picked, so this package works where triton is not installed.

`lora_masked` (one masked shrink/expand against every slot, the engine's path for few
tokens) and `slot_mask` are always the reference: three dense matmuls, and a general mask
that a per-token kernel could only use after reading it back from the device."""

from __future__ import annotations

from types import ModuleType

import torch

from lockgate.kernels.dispatch import pick
from lockgate.kernels.lora import reference
from lockgate.kernels.lora.reference import lora_masked, slot_mask


def implementation(device: torch.device) -> str:
    """Which path `sgmv` and `lora_shrink_expand` take for tensors on this device:
    "triton" or "reference" (LoRA has no CPU kernel: "cpu" runs the reference)."""
    return "triton" if pick(device) == "triton" else "reference"


def _module(device: torch.device) -> ModuleType:
    if implementation(device) == "triton":
        from lockgate.kernels.lora import triton as triton_impl
        return triton_impl
    return reference


def lora_shrink_expand(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_per_token: torch.Tensor,
    scaling: torch.Tensor,
    out_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See reference.lora_shrink_expand: same signature, same result within float rounding."""
    impl = _module(x.device)
    result: torch.Tensor = impl.lora_shrink_expand(x, out, lora_a, lora_b, slot_per_token, scaling, out_slice)
    return result


def sgmv(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_bt: torch.Tensor,
    seg_starts: list[int],
    seg_slots: list[int],
    scales: list[float],
    out_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """See reference.sgmv: same signature, same result within float rounding."""
    impl = _module(x.device)
    result: torch.Tensor = impl.sgmv(x, out, lora_a, lora_bt, seg_starts, seg_slots, scales, out_slice)
    return result


__all__ = ["implementation", "lora_masked", "lora_shrink_expand", "sgmv", "slot_mask"]
