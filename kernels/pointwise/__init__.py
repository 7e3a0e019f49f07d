"""A decoder layer's pointwise work: the residual add with the RMSNorm after it, the rotary
embedding with the K/V cache write, and the MLP's SiLU-and-mul; and the sampler's argmax
over rows of logits. Each call picks its path (kernels/dispatch.py;
`LOCKGATE_KERNELS` overrides): on the CPU in float32 the C kernel (`cpu.py`, built on first
use), else the plain-torch reference (`reference.py`; on CUDA its cache write is the Triton
kernel's). A call that wants a gradient takes the reference."""

from __future__ import annotations

import torch

from lockgate.kernels.dispatch import cpu_kernel_runs
from lockgate.kernels.pointwise import cpu, reference
from lockgate.kernels.pointwise.reference import rms_norm, rotate


def _on_cpu_kernel(*tensors: torch.Tensor) -> bool:
    # attribute checks only (t.device builds an object per call): this runs on every op
    f32 = torch.float32
    for t in tensors:
        if not t.is_cpu or t.dtype is not f32:
            return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return cpu_kernel_runs(cpu.available)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place (x None: nothing added), then HF's RMSNorm of it."""
    tensors = (residual, weight) if x is None else (x, residual, weight)
    if residual.dim() == 2 and residual.is_contiguous() and _on_cpu_kernel(*tensors):
        return cpu.add_rms_norm(None if x is None else x.contiguous(), residual, weight.contiguous(), eps)
    return reference.add_rms_norm(x, residual, weight, eps)


def rope_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """q and k rotated (cos/sin [T, 1, D]), k and v written into the caches at their slots;
    returns q [T, num_heads, D]."""
    if (qkv.dim() == 2 and qkv.is_contiguous() and key_cache.is_contiguous() and value_cache.is_contiguous()
            and _on_cpu_kernel(qkv, cos, sin, key_cache, value_cache)):
        return cpu.rope_write_kv(qkv, num_heads, num_kv_heads, cos.contiguous(), sin.contiguous(), key_cache,
                                 value_cache, slot_mapping.contiguous())
    return reference.rope_write_kv(qkv, num_heads, num_kv_heads, cos, sin, key_cache, value_cache, slot_mapping)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [rows, 2 * inter] (the gate/up projection's output)."""
    if gate_up.dim() == 2 and gate_up.is_contiguous() and _on_cpu_kernel(gate_up):
        return cpu.silu_mul(gate_up)
    return reference.silu_mul(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of x [rows, cols]: the sampler's greedy choice (and its race's)."""
    if x.dim() == 2 and x.shape[1] > 0 and x.is_contiguous() and _on_cpu_kernel(x):
        return cpu.argmax_rows(x)
    return x.argmax(dim=-1)


__all__ = ["add_rms_norm", "argmax_rows", "rms_norm", "rope_write_kv", "rotate", "silu_mul"]
