"""AutoGPTQ / GPTQModel checkpoints, format "gptq" (v1): 4- or 8-bit codes packed along the
input dimension, zero points stored minus one and packed along the output dimension, fp16
scales, and g_idx (the group of each input channel, shuffled under desc_act). The layout is
documented in kernels/quant/reference.py.

config.json: {"quant_method": "gptq", "bits": 4 | 8, "group_size": G | -1, "desc_act": bool,
"sym": bool, "checkpoint_format" (or "format"): "gptq"}. gptq_v2 (zeros stored as is),
Marlin-packed checkpoints, other bit widths, a quantized lm_head and per-module "dynamic"
overrides are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from lockgate.engine.parallel.shard import SplitLayout
from lockgate.engine.quant.packed import PackedLinear, PackedTensor, config_int, resolve_group_size
from lockgate.kernels.quant import gptq_dequantize, gptq_matmul

GPTQ_BITS = (4, 8)


def _config_bool(config: dict[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"quantization_config.{key}: {value!r} is not a boolean")
    return value


@dataclass(frozen=True, slots=True)
class GPTQConfig:
    bits: int
    group_size: int   # -1: one group over all input channels
    desc_act: bool    # informational: g_idx alone decides each input channel's group
    sym: bool         # informational: v1 stores the zero points either way

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> GPTQConfig:
        """Check a quantization_config with quant_method "gptq"; ValueError naming the field."""
        formats = {k: str(config[k]).lower() for k in ("checkpoint_format", "format") if config.get(k)}
        if len(set(formats.values())) > 1:
            raise ValueError(f"quantization_config: checkpoint_format and format disagree ({formats})")
        for key, fmt in formats.items():
            if fmt != "gptq":
                raise ValueError(f"quantization_config.{key}: {fmt!r} is not supported (only 'gptq', v1)")
        if config.get("is_marlin_format"):
            raise ValueError("quantization_config.is_marlin_format: Marlin-packed checkpoints are not supported")
        if config.get("lm_head"):
            raise ValueError("quantization_config.lm_head: a quantized lm_head is not supported")
        if config.get("dynamic"):
            raise ValueError("quantization_config.dynamic: per-module overrides are not supported")
        bits = config_int(config, "bits")
        if bits not in GPTQ_BITS:
            raise ValueError(f"quantization_config.bits: {bits} is not supported (one of {GPTQ_BITS})")
        return cls(
            bits=bits,
            group_size=config_int(config, "group_size"),
            desc_act=_config_bool(config, "desc_act", False),
            sym=_config_bool(config, "sym", True),
        )


class GPTQLinear(PackedLinear):
    """y = x @ ((q - z) * s)[g_idx] (+ b) through kernels.quant.gptq_matmul, part by part: the
    fused Triton kernel where it is picked (CUDA), else dequantized per forward into the model's
    dtype.

    Buffers (parts side by side along the output dimension): qweight int32 [in / pack, out],
    qzeros int32 [groups, out / pack], scales [groups, out], g_idx int32 [parts, in] (each HF
    layer has its own, desc_act permutes them differently), bias [out] where the model has one;
    pack = 32 / bits."""

    method = "gptq"
    # buffers registered from tensor_specs
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, config: GPTQConfig) -> None:
        self.bits = config.bits
        self.pack = 32 // config.bits
        self.config_group_size = config.group_size
        self.group_size = resolve_group_size(config.group_size, in_features)
        self.num_groups = math.ceil(in_features / self.group_size)
        if in_features % self.pack:
            raise ValueError(f"GPTQ {config.bits}-bit: in_features {in_features} is not a multiple of {self.pack}")
        if any(n % self.pack for n in out_sizes):
            raise ValueError(f"GPTQ {config.bits}-bit: output sizes {out_sizes} must be multiples of {self.pack}")
        super().__init__(in_features, out_sizes, bias)

    def tensor_specs(self) -> dict[str, PackedTensor]:
        n_in, n_out, groups, pack = self.in_features, self.out_features, self.num_groups, self.pack
        return {
            "qweight": PackedTensor((n_in // pack, n_out), True, out_dim=1),
            "qzeros": PackedTensor((groups, n_out // pack), True, out_dim=1, columns_per_element=pack),
            "scales": PackedTensor((groups, n_out), False, out_dim=1),
            "g_idx": PackedTensor((len(self.out_sizes), n_in), True, out_dim=None),
        }

    def set_split(self, split: SplitLayout) -> None:
        """A row cut keeps every group's zero points and scales: under desc_act a rank's input
        rows belong to any group (g_idx, cut with the rows, names them)."""
        super().set_split(split)
        if split.kind == "row":
            self.group_size = resolve_group_size(self.config_group_size, split.totals[0])
            self.num_groups = math.ceil(split.totals[0] / self.group_size)
            self.make_buffers()

    def checkpoint_slices(self, part: int, leaf: str, ndim: int) -> tuple[slice, ...] | None:
        """Output columns: plain columns of qweight, scales and bias, whole packed words of
        qzeros; g_idx whole. Input rows: whole packed words of qweight, g_idx's entries;
        qzeros and scales whole (see set_split)."""
        split = self.split
        if split is None:
            return None
        column, row = split.column(part), split.row()
        if column is not None:
            if leaf == "g_idx":
                return None
            start, count = column
            k = self.pack if leaf == "qzeros" else 1
            cut = slice(start // k, (start + count) // k)
            return (cut,) if ndim == 1 else (slice(None), cut)
        if row is None:
            return None
        start, count = row
        if leaf == "qweight":
            return (slice(start // self.pack, (start + count) // self.pack), slice(None))
        return (slice(start, start + count),) if leaf == "g_idx" else None

    def check_part(self, name: str, tensor: torch.Tensor) -> None:
        if name == "g_idx" and tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= self.num_groups):
            raise ValueError(
                f"g_idx has groups {int(tensor.min())}..{int(tensor.max())}, expected 0..{self.num_groups - 1}"
            )

    def _part_tensors(self, part: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """qweight, qzeros, scales, g_idx of one part (views of the buffers)."""
        lo, n = self.offsets[part], self.out_sizes[part]
        return (
            self.qweight[:, lo:lo + n],
            self.qzeros[:, lo // self.pack:(lo + n) // self.pack],
            self.scales[:, lo:lo + n],
            self.g_idx[part],
        )

    def _dequantize_part(self, part: int) -> torch.Tensor:
        return gptq_dequantize(*self._part_tensors(part), self.bits)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([self._dequantize_part(p) for p in range(len(self.out_sizes))], dim=1)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        """One part at a time (each has its own g_idx), into its slice of the output: on the
        reference path only one part's weight exists at once."""
        if len(self.out_sizes) == 1:
            return gptq_matmul(x, *self._part_tensors(0), self.bits, self.bias)
        y = x.new_empty(*x.shape[:-1], self.out_features)
        for part, (lo, n) in enumerate(zip(self.offsets, self.out_sizes, strict=True)):
            bias = None if self.bias is None else self.bias[lo:lo + n]
            y[..., lo:lo + n] = gptq_matmul(x, *self._part_tensors(part), self.bits, bias)
        return y
