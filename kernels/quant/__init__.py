"""Weight-only quantized matmul (AutoAWQ GEMM, GPTQ v1): the plain-torch dequantize-then-matmul
reference everywhere for now; a fused device kernel will be picked on CUDA when it lands,
with the same signatures."""

from kernels.quant.reference import (
    AWQ_PACK_ORDER,
    awq_dequantize,
    awq_matmul,
    awq_pack,
    awq_unpack,
    gptq_dequantize,
    gptq_matmul,
    pack_int32,
    quant_matmul,
    unpack_int32,
)

__all__ = [
    "AWQ_PACK_ORDER",
    "awq_dequantize",
    "awq_matmul",
    "awq_pack",
    "awq_unpack",
    "gptq_dequantize",
    "gptq_matmul",
    "pack_int32",
    "quant_matmul",
    "unpack_int32",
]
