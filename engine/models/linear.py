"""Projection layers the models are built from: dense, or quantized (engine/quant/), each
optionally with batched multi-LoRA on top.

A projection may fuse several Hugging Face layers along its output: `qkv_proj` is q_proj,
k_proj and v_proj side by side, `gate_up_proj` is gate_proj and up_proj. Each fused layer is
a *part*; checkpoints load part by part under HF's own tensor names (`load_part`), and a
LoRA adapter on one HF layer lands in that part's output columns.

LoRA: the LoRA manager (engine/lora.py) attaches a `LoRASlots` to every projection,
holding per part the stacked slot tensors, and sets one shared `LoRABatch` (this step's
tokens grouped by adapter slot) before each forward. Tokens of the bare base model have
slot -1 and are left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from lockgate.engine.parallel.shard import SplitLayout
from lockgate.kernels.linear import PackedWeight, gate_up_silu_mul
from lockgate.kernels.linear import linear as dense_linear
from lockgate.kernels.lora import implementation as lora_implementation
from lockgate.kernels.lora import lora_masked, sgmv, slot_mask


@dataclass(slots=True)
class LoRABatch:
    """The current step's tokens grouped by adapter: segment i is rows
    seg_starts[i]:seg_starts[i+1], all of slot seg_slots[i] (-1: the bare base model).
    `active` is False when no token of this step uses an adapter: the LoRA path then costs
    nothing."""

    active: bool = False
    seg_starts: list[int] = field(default_factory=lambda: [0])
    seg_slots: list[int] = field(default_factory=list)
    slots: frozenset[int] = frozenset()
    # few tokens: one masked shrink/expand against all slots beats a call per segment
    masked: bool = False
    scales: list[float] = field(default_factory=list)
    masks: dict[tuple[int, int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def mask(self, num_slots: int, r_max: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (num_slots, r_max, dtype)
        m = self.masks.get(key)
        if m is None:
            m = self.masks[key] = slot_mask(self.seg_starts, self.seg_slots, self.scales, num_slots,
                                            r_max, dtype, device)
        return m


@dataclass(slots=True)
class LoRASlots:
    """One projection's adapter slots, all parts stacked so that one shrink and one expand
    serve a fused projection: lora_a [slots, P * r_max, in] holds part p's A in rows
    p * r_max:(p + 1) * r_max; lora_bt [slots, P * r_max, out_total] holds the B's
    transposed, block-diagonal: part p's B^T in its rank rows and its output columns, zeros
    elsewhere. `scales` per slot
    (alpha / r, or alpha / sqrt(r) for rsLoRA); `targeted` the slots whose adapter adapts
    some part of this projection (the others are skipped)."""

    lora_a: torch.Tensor
    lora_bt: torch.Tensor
    scales: list[float]
    targeted: set[int]
    batch: LoRABatch


class LinearBase(nn.Module):
    """y = x W^T (+ b), W being the parts stacked along the output dimension."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_sizes = list(out_sizes)
        self.out_features = sum(out_sizes)
        self.offsets = [sum(out_sizes[:i]) for i in range(len(out_sizes))]
        self.has_bias = bias
        self.lora: LoRASlots | None = None
        # with tensor parallelism: how this rank's slice is cut from the checkpoint's tensors
        # (engine/parallel/shard.py); None: the whole projection
        self.split: SplitLayout | None = None

    # -- what a subclass provides ---------------------------------------------------------
    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def load_part(self, part: int, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (`name` is its last component: weight, bias, qweight...)
        of HF layer `part`. Raises ValueError on an unknown name or a wrong shape."""
        raise NotImplementedError

    def expected_tensors(self) -> set[tuple[int, str]]:
        """Every (part, name) a complete checkpoint provides for this projection."""
        raise NotImplementedError

    def dense_weight(self) -> torch.Tensor:
        """The full-precision weight [out, in] (dequantized where quantized), for checks."""
        raise NotImplementedError

    def checkpoint_slices(self, part: int, leaf: str, ndim: int) -> tuple[slice, ...] | None:
        """What this rank reads of checkpoint tensor `leaf` of part `part` (None: all of it).
        The dense layout (weight [out, in]); a quantized projection's packed tensors are laid
        out otherwise and need their own."""
        return None if self.split is None else self.split.dense_slices(part, leaf, ndim)

    def set_split(self, split: SplitLayout) -> None:
        """This projection is one rank's slice (set while the model is built, before loading)."""
        self.split = split

    def full_sizes(self, part: int) -> tuple[int, int]:
        """(input features, part's output rows) of the unsplit projection: what an adapter or
        a checkpoint tensor of the whole model has."""
        split, n_in, n_out = self.split, self.in_features, self.out_sizes[part]
        if split is None:
            return n_in, n_out
        return (n_in, split.totals[part]) if split.kind == "column" else (split.totals[0], n_out)

    def fused_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """A gated MLP's [gate; up] projection: silu(gate) * up in one kernel pass where one
        serves, else None (the caller projects and applies the activation)."""
        return None

    # -- shared -------------------------------------------------------------------------
    def adapted(self) -> bool:
        """Whether the step's adapters add anything to this projection."""
        lora = self.lora
        return lora is not None and lora.batch.active and not lora.targeted.isdisjoint(lora.batch.slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        lora = self.lora
        if lora is not None and self.adapted():
            batch = lora.batch
            # the Triton SGMV serves every segment in one launch, so the masked form (which
            # pays off only against a call per segment) is for the reference alone
            if batch.masked and lora_implementation(x.device) != "triton":
                # slots that do not adapt this projection hold zeros: no need to mask them
                num_slots, width, _ = lora.lora_a.shape
                lora_masked(x, y, lora.lora_a, lora.lora_bt, batch.mask(num_slots, width, x.dtype, x.device))
            else:
                seg_slots = [s if s in lora.targeted else -1 for s in batch.seg_slots]
                sgmv(x, y, lora.lora_a, lora.lora_bt, batch.seg_starts, seg_slots, lora.scales)
        return y


class DenseLinear(LinearBase):
    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, out_sizes, bias)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features))
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.packed = PackedWeight()    # the weight as the CPU kernel wants it, made on first use

    def as_gate_up(self) -> None:
        """Marks a gated MLP's [gate; up] projection (two equal parts, no bias): its packed
        copy is made in pairs, which serves both `forward` and `fused_silu_mul`."""
        if len(self.out_sizes) == 2 and self.out_sizes[0] == self.out_sizes[1] and not self.has_bias:
            self.packed = PackedWeight(pairs_of=self.out_sizes[0])

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias, self.packed)

    def fused_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        # an adapter's delta lands between the projection and the activation: not fused then
        return None if self.adapted() else gate_up_silu_mul(x, self.weight, self.packed)

    def load_part(self, part: int, name: str, tensor: torch.Tensor) -> None:
        param = self.weight if name == "weight" else self.bias if name == "bias" else None
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} for a dense projection")
        dst = param.data.narrow(0, self.offsets[part], self.out_sizes[part])
        if dst.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)

    def expected_tensors(self) -> set[tuple[int, str]]:
        names = ("weight", "bias") if self.has_bias else ("weight",)
        return {(p, n) for p in range(len(self.out_sizes)) for n in names}

    def dense_weight(self) -> torch.Tensor:
        return self.weight.data


# builds one projection: (in_features, out_sizes, bias) -> LinearBase
LinearFactory = Callable[[int, list[int], bool], LinearBase]
