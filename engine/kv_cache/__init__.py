"""The paged KV cache: the block pool (blocks, reference counts, free queues, prefix-cache map)
and the per-sequence block tables with their hash chains."""

from lockgate.engine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from lockgate.engine.kv_cache.manager import KVCacheManager, hash_block

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "KVCacheManager", "hash_block"]
