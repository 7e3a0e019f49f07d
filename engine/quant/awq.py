"""AutoAWQ checkpoints, GEMM version: 4-bit codes packed 8 to an int32 along the output
dimension in AWQ's interleaved order, per-group zero points packed the same way, fp16 scales.
The layout is documented in kernels/quant/reference.py.

config.json: {"quant_method": "awq", "bits": 4 (or "w_bit"), "group_size": G (or
"q_group_size"), "zero_point": true, "version": "gemm"}. GEMV, GEMV-fast, Marlin and
exllama versions pack differently and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lockgate.engine.quant.packed import PackedLinear, PackedTensor, config_int, resolve_group_size
from lockgate.kernels.quant import awq_dequantize, awq_matmul

AWQ_PACK = 8   # 4-bit codes per int32
_PROJECTION_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "self_attn", "mlp", "layers")


@dataclass(frozen=True, slots=True)
class AWQConfig:
    group_size: int   # -1: one group over all input channels

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AWQConfig:
        """Check a quantization_config with quant_method "awq"; ValueError naming the field."""
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version: {version!r} is not supported (only 'gemm')")
        bits = config_int(config, "bits", "w_bit")
        if bits != 4:
            raise ValueError(f"quantization_config.bits: {bits} is not supported (AWQ GEMM is 4-bit)")
        if config.get("zero_point", True) is not True:
            raise ValueError(f"quantization_config.zero_point: {config['zero_point']!r} is not supported (only true)")
        skipped = [m for m in config.get("modules_to_not_convert") or () if any(p in str(m) for p in _PROJECTION_NAMES)]
        if skipped:
            raise ValueError(
                f"quantization_config.modules_to_not_convert: {skipped!r} would leave projections in full "
                "precision, which is not supported"
            )
        return cls(group_size=config_int(config, "group_size", "q_group_size"))


class AWQLinear(PackedLinear):
    """y = x @ ((q - z) * s) (+ b) through kernels.quant.awq_matmul: the fused Triton kernel
    where it is picked (CUDA), else dequantized per forward into the model's dtype.

    Buffers (parts side by side along the output dimension, as the checkpoint's tensors are
    laid out per HF layer): qweight int32 [in, out / 8], qzeros int32 [groups, out / 8],
    scales [groups, out], bias [out] where the model has one."""

    method = "awq"
    # buffers registered from tensor_specs
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, config: AWQConfig) -> None:
        self.whole_input_group = config.group_size == -1
        self.group_size = resolve_group_size(config.group_size, in_features)
        if in_features % self.group_size:
            raise ValueError(
                f"quantization_config.group_size: {self.group_size} does not divide in_features {in_features}"
            )
        if any(n % AWQ_PACK for n in out_sizes):
            raise ValueError(f"AWQ: output sizes {out_sizes} must be multiples of {AWQ_PACK}")
        super().__init__(in_features, out_sizes, bias)

    def tensor_specs(self) -> dict[str, PackedTensor]:
        n_in, n_out, groups = self.in_features, self.out_features, self.in_features // self.group_size
        return {
            "qweight": PackedTensor((n_in, n_out // AWQ_PACK), True, out_dim=1, columns_per_element=AWQ_PACK),
            "qzeros": PackedTensor((groups, n_out // AWQ_PACK), True, out_dim=1, columns_per_element=AWQ_PACK),
            "scales": PackedTensor((groups, n_out), False, out_dim=1),
        }

    def checkpoint_slices(self, part: int, leaf: str, ndim: int) -> tuple[slice, ...] | None:
        """Output columns: whole packed words of qweight and qzeros (8 columns each), plain
        columns of scales and bias. Input rows: qweight's rows and the groups they make up
        (check_tensor_parallel has made sure a rank's rows are whole groups)."""
        split = self.split
        if split is None:
            return None
        column, row = split.column(part), split.row()
        if column is not None:
            start, count = column
            k = AWQ_PACK if leaf in ("qweight", "qzeros") else 1
            cut = slice(start // k, (start + count) // k)
            return (cut,) if ndim == 1 else (slice(None), cut)
        if row is None or leaf == "bias":
            return None
        start, count = row
        if leaf == "qweight":
            return (slice(start, start + count), slice(None))
        if self.whole_input_group:
            return None                      # one group over every input row: its one row
        g = self.group_size
        return (slice(start // g, (start + count) // g), slice(None))

    def dequantize(self) -> torch.Tensor:
        return awq_dequantize(self.qweight, self.qzeros, self.scales, self.group_size)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        # the parts side by side are one AWQ tensor set (every part a multiple of 8 columns)
        return awq_matmul(x, self.qweight, self.qzeros, self.scales, self.group_size, self.bias)
