"""A decoder layer's pointwise work in plain torch: what every device runs and what the CPU
kernel (cpu.py) is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalized in float32, scaled in the model's dtype."""
    if x.dtype == torch.float32:   # one fused op; same result as the spelled-out form
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place; x None: nothing added), then rms_norm(residual)."""
    if x is not None:
        residual.add_(x)
    return rms_norm(residual, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, the rotate-half form (Llama, Mistral, Qwen2): x [T, H, D], cos/sin
    [T, 1, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_write_kv(
    qkv: torch.Tensor,            # [T, (num_heads + 2 * num_kv_heads) * head_dim]
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,            # [T, 1, head_dim]
    sin: torch.Tensor,
    key_cache: torch.Tensor,      # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,   # [T] int64
) -> torch.Tensor:
    """q and k rotated, k and v written into the caches at their slots; returns q [T, H, D]."""
    from lockgate.kernels.paged_attention import write_kv_cache

    d = key_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = rotate(q.view(-1, num_heads, d), cos, sin)
    k = rotate(k.view(-1, num_kv_heads, d), cos, sin)
    write_kv_cache(k, v.view(-1, num_kv_heads, d), key_cache, value_cache, slot_mapping)
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The gated MLP's activation: silu(gate) * up of gate_up [..., 2 * inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
