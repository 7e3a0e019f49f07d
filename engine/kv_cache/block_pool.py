"""The block pool: every KV block of the device cache, its reference count and its hash.

Free blocks wait in doubly linked queues (O(1) removal from the middle, for a prefix-cache
hit on a free block), one per eviction tier. Blocks that still hold a cached prefix are
appended at the tail of their tier's queue and evicted from the head, least recently freed
first; blocks that hold nothing reusable go to the head of tier 0 so they are reused before
any cached one. Allocation drains tier 0 first: the engine frees the blocks of less urgent
service classes into lower tiers, so cached blocks of offline work are evicted before those
of online work. No torch here: block ids only.

Contiguity. Attention on CPU reads a sequence whose blocks are consecutive ids as one view of
the cache, and must copy (gather) the blocks of any other (kernels/paged_attention): the copy
was most of the decode step. So a sequence's first blocks are placed at the start of a free
run long enough for its expected length (prompt + max_tokens), the rest of that run is
reserved for it, and it grows into the next block when that block is free. Reservations are
soft: they hold no memory and count as free, and plain `allocate` still takes reserved blocks
when nothing else is free (the owner then grows elsewhere, and its attention gathers).
`clean` marks the blocks a placement may use without evicting anything: free, uncached,
unreserved; `bytearray.find` looks for a run of them in C.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

BlockHash = bytes


class KVBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt", "tag", "tier")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.tier = 0
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.tag: Any = None      # who cached it (see KVCacheManager._tag), for invalidation
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
        if prev is None or nxt is None:
            raise ValueError("a free block links between two queued blocks, got an unlinked neighbour")
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
        self.clean = bytearray(b"\x01") * num_blocks    # free, uncached and reserved for no one
        self.reserved_by = [0] * num_blocks              # the owner of a block's soft reservation
        self.extents: dict[int, tuple[int, int]] = {}    # owner -> its reserved [start, end)
        # told of every cached block as it is evicted, contents still intact (a KV tier)
        self.on_evict: Callable[[KVBlock], None] | None = None
        # told when a hash enters or leaves `cached` (engine/kv_cache/events.py)
        self.listener: Callable[[str, BlockHash | None], None] | None = None

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
            self.clean[block.block_id] = 0
            out.append(block)
        return out

    # -- contiguous placement ----------------------------------------------------------------
    def allocate_run(self, num_blocks: int, want: int, owner: int) -> list[KVBlock]:
        """The first `num_blocks` of a free run of `want` consecutive blocks, the rest of the
        run reserved for `owner`; [] when there is no such run. Runs of clean blocks first;
        else a run that ends or starts at one of the next blocks to evict (its neighbours
        were mostly freed with it, so this evicts about what `allocate` would)."""
        start = self.clean.find(b"\x01" * want)
        if start < 0:
            at_head = self._run_at_eviction_head(want)
            if at_head is None:
                return []
            start = at_head
        out = [self._take(self.blocks[i]) for i in range(start, start + num_blocks)]
        if want > num_blocks:
            self.extents[owner] = (start + num_blocks, start + want)
            for i in range(start + num_blocks, start + want):
                self.reserved_by[i] = owner
                self.clean[i] = 0
        return out

    def allocate_next(self, last_id: int, num_blocks: int, owner: int, want: int = 0) -> list[KVBlock]:
        """Up to `num_blocks` blocks right after block `last_id`, each free and either
        reserved for `owner` or clean (an unreserved cached block is left to the LRU). An
        owner without a reservation yet (its first blocks were a shared prefix) reserves
        the clean blocks that follow, up to `want` blocks in all."""
        out: list[KVBlock] = []
        i = last_id + 1
        while len(out) < num_blocks and i < self.num_blocks:
            block = self.blocks[i]
            if block.ref_cnt or (self.reserved_by[i] != owner and not self.clean[i]):
                break
            out.append(self._take(block))
            i += 1
        if len(out) == num_blocks and want > num_blocks and owner not in self.extents:
            end = i
            while end < min(self.num_blocks, i + want - num_blocks) and self.clean[end]:
                self.reserved_by[end] = owner
                self.clean[end] = 0
                end += 1
            if end > i:
                self.extents[owner] = (i, end)
        return out

    def unreserve(self, owner: int) -> None:
        """Drop `owner`'s reservation (it finished or was preempted)."""
        extent = self.extents.pop(owner, None)
        if extent is None:
            return
        for i in range(*extent):
            if self.reserved_by[i] == owner:
                self.reserved_by[i] = 0
                block = self.blocks[i]
                self.clean[i] = block.ref_cnt == 0 and block.block_hash is None

    def _run_at_eviction_head(self, want: int, tries: int = 4) -> int | None:
        """The start of a free, unreserved run of `want` blocks that ends or starts at one
        of the next `tries` blocks to evict, and whose cached blocks are all among the next
        2 x `want` to evict. A request's blocks are freed tail first, so the eviction head is
        usually the last block of the oldest request: the run ending there is that request's
        own. The bound keeps the run from reaching into a prefix freed (or hit) recently that
        happens to lie beside the head: that is a tenant's shared prefix, and evicting it
        out of turn makes its next request compute it again."""
        soon: set[int] = set()
        heads: list[KVBlock] = []
        for block in (b for q in self.free_queues for b in q):
            if len(soon) == 2 * want:
                break
            soon.add(block.block_id)
            if len(heads) < tries:
                heads.append(block)
        blocks, reserved = self.blocks, self.reserved_by
        for head in heads:
            for start in (head.block_id - want + 1, head.block_id):
                if start >= 0 and start + want <= self.num_blocks and all(
                        blocks[i].ref_cnt == 0 and not reserved[i]
                        and (blocks[i].block_hash is None or i in soon) for i in range(start, start + want)):
                    return start
        return None

    def _take(self, block: KVBlock) -> KVBlock:
        """A specific free block, out of its queue (its cached prefix, if any, evicted)."""
        self.free_queues[block.tier].remove(block)
        self._evict(block)
        block.ref_cnt = 1
        self.clean[block.block_id] = 0
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Share already-filled blocks (a prefix hit or a sibling's prompt): one more reference."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queues[block.tier].remove(block)
                self.clean[block.block_id] = 0
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
                    self.clean[block.block_id] = not self.reserved_by[block.block_id]

    def cache_block(self, block: KVBlock, block_hash: BlockHash, tag: Any = None) -> None:
        """Record that `block` now holds the full block identified by `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # another request filled the same prefix first
            return
        block.block_hash, block.tag = block_hash, tag
        self.cached[block_hash] = block
        if self.listener is not None:
            self.listener("stored", block_hash)

    def uncache(self, match: Callable[[Any], bool]) -> None:
        """Forget the cached prefix of every block whose tag matches (its adapter unloaded,
        its tenant deleted): free ones are reused first, held ones stay with their owner."""
        for block in [b for b in self.cached.values() if match(b.tag)]:
            del self.cached[block.block_hash]       # type: ignore[arg-type]
            if self.listener is not None:
                self.listener("removed", block.block_hash)
            block.block_hash = block.tag = None
            if block.ref_cnt == 0:
                self.free_queues[block.tier].remove(block)
                block.tier = 0
                self.free_queue.appendleft(block)
                self.clean[block.block_id] = not self.reserved_by[block.block_id]

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block)
                if self.listener is not None:
                    self.listener("removed", block.block_hash)
            block.block_hash = block.tag = None
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
        for block in self.blocks:
            i = block.block_id
            clean = block.ref_cnt == 0 and block.block_hash is None and not self.reserved_by[i]
            if self.clean[i] != clean:
                raise AssertionError(f"{block}: clean map says {self.clean[i]}, should be {clean}")
            if self.reserved_by[i]:
                start, end = self.extents.get(self.reserved_by[i], (0, 0))
                if not start <= i < end:
                    raise AssertionError(f"{block}: reserved outside its owner's extent")
        for h, block in self.cached.items():
            if block.block_hash != h:
                raise AssertionError(f"{block}: cache map points at a block with another hash")
