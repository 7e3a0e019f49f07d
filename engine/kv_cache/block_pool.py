"""The block pool: every KV block of the device cache, its reference count and its hash.

Free blocks wait in doubly linked queues (O(1) removal from the middle, for a prefix-cache
hit on a free block), one per eviction tier. Blocks that still hold a cached prefix are
appended at the tail of their tier's queue and evicted from the head, least recently freed
first; blocks that hold nothing reusable go to the head of tier 0 so they are reused before
any cached one. Allocation drains tier 0 first: the engine frees the blocks of less urgent
service classes into lower tiers, so cached blocks of offline work are evicted before those
of online work. No torch here: block ids only.
"""

from __future__ import annotations

from collections.abc import Iterable

BlockHash = bytes


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free", "tier")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.tier = 0
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels at both ends."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev_free, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self._head, self._head.next_free)

    def _link(self, block: KVBlock, prev: KVBlock | None, nxt: KVBlock | None) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        assert prev is not None and nxt is not None
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns all blocks: allocation, reference counts and the prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_tiers: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_tiers < 1:
            raise ValueError(f"num_tiers must be >= 1, got {num_tiers}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queues = [FreeBlockQueue(self.blocks)] + [FreeBlockQueue(()) for _ in range(num_tiers - 1)]
        self.free_queue = self.free_queues[0]      # tier 0: evicted first
        self.cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return sum(q.num_free for q in self.free_queues)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Take `num_blocks` fresh blocks (evicting cached ones from the LRU head), or None."""
        if num_blocks > self.num_free_blocks:
            return None
        out = []
        queues = iter(self.free_queues)
        queue = next(queues)
        for _ in range(num_blocks):
            while queue.num_free == 0:
                queue = next(queues)
            block = queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Share already-filled blocks (a prefix hit or a sibling's prompt): one more reference."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queues[block.tier].remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock], tier: int = 0) -> None:
        """Drop one reference from each block; blocks that reach zero go back to a queue:
        cached ones to the tail of `tier`'s, empty ones to the head of tier 0.

        Pass a request's blocks tail first so that, under pressure, the tail of a prefix is
        evicted before its head.
        """
        tier = min(max(tier, 0), len(self.free_queues) - 1)
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    block.tier = tier
                    self.free_queues[tier].append(block)
                else:
                    block.tier = 0
                    self.free_queue.appendleft(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record that `block` now holds the full block identified by `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # another request filled the same prefix first
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def check_integrity(self) -> None:
        """Raise if counts don't add up (used by tests at every step)."""
        free_ids = []
        for tier, queue in enumerate(self.free_queues):
            ids = [b.block_id for b in queue]
            if len(ids) != queue.num_free or any(self.blocks[i].tier != tier for i in ids):
                raise AssertionError(f"free queue of tier {tier} corrupted")
            free_ids += ids
        if len(set(free_ids)) != len(free_ids):
            raise AssertionError("a block is in two free queues")
        for block in self.blocks:
            in_free = block.prev_free is not None
            if (block.ref_cnt == 0) != in_free:
                raise AssertionError(f"{block}: ref count and free-queue membership disagree")
            if block.ref_cnt < 0:
                raise AssertionError(f"{block}: negative ref count")
        for h, block in self.cached.items():
            if block.block_hash != h:
                raise AssertionError(f"{block}: cache map points at a block with another hash")
