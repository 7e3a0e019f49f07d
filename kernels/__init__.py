"""Device kernels, each in a subpackage of its own beside a plain-torch reference with the
same signature: `from kernels.paged_attention import paged_attention, write_kv_cache`."""
