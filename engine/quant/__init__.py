"""Quantized checkpoints: which projection class a model's config.json asks for.

Weight-only 4/8-bit formats, read as AutoAWQ and AutoGPTQ / GPTQModel write them:
`AWQLinear` (quant_method "awq", GEMM version) and `GPTQLinear` (quant_method "gptq", v1
format, desc_act included). Both keep the packed tensors and dequantize per forward through
kernels/quant; `lockgate quantize` (engine/quant/quantize.py) writes such checkpoints.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from lockgate.engine.models.linear import DenseLinear, LinearFactory
from lockgate.engine.quant.awq import AWQConfig, AWQLinear
from lockgate.engine.quant.gptq import GPTQConfig, GPTQLinear

QUANT_METHODS = ("awq", "gptq")

__all__ = ["QUANT_METHODS", "AWQConfig", "AWQLinear", "GPTQConfig", "GPTQLinear", "linear_factory"]


def linear_factory(quantization: dict[str, Any] | None) -> LinearFactory:
    """The projection class for a model's `quantization_config` (None: full precision).
    Raises ValueError naming the field and value when it is not one Lockgate reads."""
    if not quantization:
        return DenseLinear
    method = str(quantization.get("quant_method", "")).lower()
    if method == "awq":
        return partial(AWQLinear, config=AWQConfig.from_dict(quantization))
    if method == "gptq":
        return partial(GPTQLinear, config=GPTQConfig.from_dict(quantization))
    raise ValueError(f"quantization_config.quant_method: {method!r} is not supported (one of {QUANT_METHODS})")
