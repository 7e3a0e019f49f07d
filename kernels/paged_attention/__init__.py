"""Paged attention. `paged_attention` picks the implementation per call: on the CPU in
float32 the C decode kernel (`cpu.py`, built on first use; `LOCKGATE_KERNELS=reference`
turns it off), else the plain-torch reference (`reference.py`), which every other kernel is
checked against. The Triton kernel for CUDA is its own issue."""

from __future__ import annotations

import torch

from kernels.paged_attention import cpu, reference
from kernels.paged_attention.reference import contiguous_first_slots, write_kv_cache


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_slots: list[int] | None = None,
) -> torch.Tensor:
    """See reference.paged_attention: same signature, same result within float rounding."""
    if implementation(query.device, query.dtype) == "cpu":
        return cpu.paged_attention(query.contiguous(), key_cache, value_cache, block_tables,
                                   seq_lens, query_start_loc, scale, first_slots)
    return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, scale, first_slots)


def implementation(device: torch.device, dtype: torch.dtype) -> str:
    """Which path `paged_attention` takes for these: "cpu" or "reference"."""
    return "cpu" if device.type == "cpu" and dtype == torch.float32 and cpu.available() else "reference"


__all__ = ["contiguous_first_slots", "implementation", "paged_attention", "write_kv_cache"]
