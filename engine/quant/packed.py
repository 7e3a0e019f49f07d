"""What AWQ and GPTQ projections share: packed checkpoint tensors kept as buffers, the fused
parts side by side along the output dimension, loaded part by part and checked on the way.

Each format declares its tensors as `PackedTensor`s: the buffer of the whole projection and
how one part's checkpoint tensor maps into it. Integer buffers stay int32 through the
loader's `.to(dtype)`; floating ones (scales, bias) take the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lockgate.engine.models.linear import LinearBase


@dataclass(frozen=True, slots=True)
class PackedTensor:
    shape: tuple[int, ...]          # the whole projection's buffer
    integer: bool                   # int32 (packed codes, g_idx) or floating (scales, bias)
    out_dim: int | None             # parts sit side by side along this dim; None: one row per part
    columns_per_element: int = 1    # output columns one element along out_dim covers


def config_int(config: dict[str, Any], *keys: str) -> int:
    """The first of `keys` present in a quantization_config, as an int; ValueError naming the
    field when none is present or it is not an integer."""
    for key in keys:
        if key in config and config[key] is not None:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"quantization_config.{key}: {value!r} is not an integer")
            return value
    raise ValueError(f"quantization_config.{keys[0]} is missing")


def resolve_group_size(group_size: int, in_features: int, field: str = "group_size") -> int:
    """-1 means one group over all input channels."""
    if group_size == -1:
        return in_features
    if group_size <= 0:
        raise ValueError(f"quantization_config.{field}: {group_size} must be positive or -1")
    return group_size


class PackedLinear(LinearBase):
    """A projection whose weight lives as packed tensors; subclasses name them (`specs`) and
    dequantize in `base_forward`. The dequantized weight is never kept."""

    method = "packed"

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, out_sizes, bias)
        self.specs: dict[str, PackedTensor] = {}
        self.make_buffers()
        if not bias:
            self.bias: torch.Tensor | None = None

    def make_buffers(self) -> None:
        """(Re)register the buffers `tensor_specs` names, empty (filled by the loader)."""
        self.specs = self.tensor_specs()
        if self.has_bias:
            self.specs["bias"] = PackedTensor((self.out_features,), integer=False, out_dim=0)
        for name, spec in self.specs.items():
            dtype = torch.int32 if spec.integer else torch.get_default_dtype()
            self.register_buffer(name, torch.empty(spec.shape, dtype=dtype))

    def tensor_specs(self) -> dict[str, PackedTensor]:
        raise NotImplementedError

    def check_part(self, name: str, tensor: torch.Tensor) -> None:
        """Format-specific value checks on one part's tensor (e.g. g_idx in range)."""

    def load_part(self, part: int, name: str, tensor: torch.Tensor) -> None:
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(
                f"unexpected tensor {name!r} for a {self.method} projection (expected {sorted(self.specs)})"
            )
        if spec.integer and tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        if not spec.integer and not tensor.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {tensor.dtype}")
        buf: torch.Tensor = getattr(self, name)
        if spec.out_dim is None:
            dst = buf[part]
        else:
            k = spec.columns_per_element
            dst = buf.narrow(spec.out_dim, self.offsets[part] // k, self.out_sizes[part] // k)
        if dst.shape != tensor.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        self.check_part(name, tensor)
        dst.copy_(tensor)

    def expected_tensors(self) -> set[tuple[int, str]]:
        return {(p, name) for p in range(len(self.out_sizes)) for name in self.specs}

    def dense_weight(self) -> torch.Tensor:
        return self.dequantize().t()

    def dequantize(self) -> torch.Tensor:
        """The whole weight [in, out], parts side by side, in the scales' dtype."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_sizes={self.out_sizes}, bias={self.has_bias}"
