from engine.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from engine.kv_cache.manager import KVCacheManager, hash_block

__all__ = ["BlockPool", "FreeBlockQueue", "KVBlock", "KVCacheManager", "hash_block"]
