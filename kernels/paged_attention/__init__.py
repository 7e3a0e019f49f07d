"""Paged attention. `paged_attention` and `write_kv_cache` pick their implementation per
call (kernels/dispatch.py; `LOCKGATE_KERNELS` overrides): the Triton kernels (`triton.py`)
on CUDA, or on the CPU under Triton's interpreter when asked for; on the CPU in float32 the
C decode kernel (`cpu.py`, built on first use); else the plain-torch reference
(`reference.py`), which every other kernel is checked against. `triton` is imported only
when its path is taken: without it installed, everything else works."""

from __future__ import annotations

import torch

from lockgate.kernels.dispatch import pick
from lockgate.kernels.paged_attention import cpu, reference
from lockgate.kernels.paged_attention.reference import contiguous_first_slots


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_slots: list[int] | None = None,
    step_cache: dict | None = None,
) -> torch.Tensor:
    """See reference.paged_attention: same signature, same result within float rounding.
    `step_cache`: a dict kept for the layers of one forward (the same metadata), where a
    path may keep what it works out from the metadata once for all of them."""
    path = implementation(query.device, query.dtype)
    if path == "triton":
        from lockgate.kernels.paged_attention import triton as triton_kernels

        return triton_kernels.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                              query_start_loc, scale, first_slots)
    if path == "cpu":
        return cpu.paged_attention(query.contiguous(), key_cache, value_cache, block_tables,
                                   seq_lens, query_start_loc, scale, first_slots, step_cache)
    return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, scale, first_slots)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See reference.write_kv_cache (no CPU kernel: the reference is the CPU path)."""
    if pick(key.device) == "triton":
        from lockgate.kernels.paged_attention import triton as triton_kernels

        triton_kernels.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def implementation(device: torch.device, dtype: torch.dtype) -> str:
    """Which path `paged_attention` takes for these: "triton", "cpu" or "reference"."""
    return pick(device, has_cpu_kernel=device.type == "cpu" and dtype == torch.float32 and cpu.available())


__all__ = ["contiguous_first_slots", "implementation", "paged_attention", "write_kv_cache"]
