"""Paged attention: the plain-torch reference everywhere for now; the Triton kernel will be
picked on CUDA when it lands (its own issue), with the same signature."""

from kernels.paged_attention.reference import contiguous_first_slots, paged_attention, write_kv_cache

__all__ = ["contiguous_first_slots", "paged_attention", "write_kv_cache"]
