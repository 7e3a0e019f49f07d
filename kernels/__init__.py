"""Device kernels, each beside a plain-torch reference with the same signature."""

from kernels.paged_attention import paged_attention, write_kv_cache

__all__ = ["paged_attention", "write_kv_cache"]
