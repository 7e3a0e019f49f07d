"""Rotary position embeddings (the rotate-half form Llama, Mistral and Qwen2 use), with the
frequency scalings their configs name."""

from __future__ import annotations

import math
from typing import Any

import torch

from lockgate.kernels.pointwise import rotate


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope_scaling: type {kind!r} is not supported (default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths divided by `factor`, short ones kept, and a
    smooth blend between the two thresholds."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to `max_positions`, computed once."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)
        self.half = head_dim // 2

    def at(self, positions: torch.Tensor) -> RopeAt:
        # index_select, not cos[positions]: the same rows, copied whole by a kernel made for
        # it, where advanced indexing takes the general (and on the CPU much slower) path
        return RopeAt(self.cos.index_select(0, positions).unsqueeze(1),
                      self.sin.index_select(0, positions).unsqueeze(1), self.half)


class RopeAt:
    """The rotation for one batch's positions: cos/sin rows [T, 1, D], applied to [T, H, D]."""

    __slots__ = ("cos", "half", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, half: int) -> None:
        self.cos, self.sin, self.half = cos, sin, half

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.cos, self.sin)
