"""Quantized checkpoints: which projection class a model's config.json asks for."""

from __future__ import annotations

from typing import Any

from engine.models.linear import DenseLinear, LinearFactory


def linear_factory(quantization: dict[str, Any] | None) -> LinearFactory:
    """The projection class for a model's `quantization_config` (None: full precision).
    Raises ValueError naming the method when it is not one Lockgate reads."""
    if not quantization:
        return DenseLinear
    method = str(quantization.get("quant_method", "")).lower()
    raise ValueError(f"model: quantization method {method!r} is not supported")
