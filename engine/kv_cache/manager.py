"""Per-sequence block tables over the block pool, and prefix-cache lookups.

A sequence holds exactly the blocks its computed-or-scheduled tokens need: block i holds
tokens [i * block_size, (i + 1) * block_size). A full block is identified by a hash chain,
SHA-256 over (parent hash, model variant, sharing scope, cache salt, its token ids), so
equal hashes mean equal contents from the first token on. The sharing scope is the tenant,
or a share group an operator named: tenants never hit (nor time) each other's prefixes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

from lockgate.engine.kv_cache.block_pool import BlockHash, BlockPool, KVBlock
from lockgate.engine.kv_cache.host_tier import HostKVTier, Tag
from lockgate.engine.request import Sequence
from lockgate.engine.stats import KVStats

ROOT_HASH = b"lockgate-kv-root"


def hash_block(parent: BlockHash | None, token_ids: list[int], extra: bytes) -> BlockHash:
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(extra)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def cache_scope(tenant: str, share_group: str | None) -> str:
    """Who may share a request's cached blocks: its share group, else its tenant alone."""
    return f"g:{share_group}" if share_group else f"t:{tenant}"


def block_salt(model: str, variant: str, scope: str, cache_salt: str | None) -> bytes:
    """What every block hash of a request mixes in besides its tokens; length-prefixed, so no
    (model, adapter, scope, salt) tuple can spell another."""
    parts = [model.encode(), variant.encode(), scope.encode(), (cache_salt or "").encode()]
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_tiers: int = 1, host_tier: HostKVTier | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching, num_tiers)
        # the second KV tier (host memory): evicted prefix blocks go there, hits come back
        self.host = host_tier if enable_caching else None
        if self.host is not None:
            self.pool.on_evict = self._offload
        self._drops: list[Callable[[Tag], bool]] = []   # invalidations from other threads
        # price of recomputing tokens (count, computed before them) in seconds; the engine
        # sets it from the step-cost model
        self.recompute_s: Callable[[int, int], float | None] = lambda _n, _c: None
        self.enable_caching = enable_caching
        self.tables: dict[int, list[KVBlock]] = {}   # id(sequence) -> its blocks
        self.ids: dict[int, list[int]] = {}          # the same as block ids, kept in step (read every step)
        self.num_registered: dict[int, int] = {}     # id(sequence) -> its leading blocks already cached
        self.num_cache_queries = 0
        self.num_cache_hits = 0   # in tokens
        # a new sequence reserves room to grow by at most this many blocks past its prompt
        self.max_reserve_blocks = max(16, num_blocks // 32)

    def reset(self) -> None:
        """The cache's memory is gone (the model was offloaded): every block free, no cached
        prefix. Only when no sequence holds a block."""
        if self.tables:
            raise RuntimeError(f"kv cache reset while {len(self.tables)} sequences hold blocks")
        evicted, listener = self.pool.num_evictions, self.pool.listener
        self.pool = BlockPool(self.pool.num_blocks, self.enable_caching, len(self.pool.free_queues))
        self.pool.num_evictions, self.pool.listener = evicted, listener
        self.num_registered.clear()
        if self.host is not None:   # the weights may be read again changed: no old block holds
            self.host.clear()
            self.pool.on_evict = self._offload
        if listener is not None:
            listener("cleared", None)

    # -- lookups ---------------------------------------------------------------------------
    def blocks_of(self, seq: Sequence) -> list[KVBlock]:
        return self.tables.get(id(seq), [])

    def block_ids(self, seq: Sequence) -> list[int]:
        """The block ids of `seq` (the manager's own list: read it, do not change it)."""
        return self.ids.get(id(seq), [])

    @staticmethod
    def _tag(seq: Sequence) -> Tag:
        req = seq.state.req
        return (req.model or "", req.lora_id, cache_scope(req.tenant, req.share_group))

    def _extra_key(self, seq: Sequence) -> bytes:
        req = seq.state.req
        lora = req.lora_request
        variant = f"{lora.lora_int_id}:{lora.lora_name}" if lora is not None else ""
        return block_salt(req.model or "", variant, cache_scope(req.tenant, req.share_group), req.cache_salt)

    def update_hashes(self, seq: Sequence) -> None:
        """Extend `seq.block_hashes` over every full block of its known tokens."""
        bs = self.block_size
        num_full = seq.num_tokens // bs
        extra = self._extra_key(seq)
        hashes = seq.block_hashes
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], extra))

    def get_computed_blocks(self, seq: Sequence) -> list[KVBlock]:
        """The longest cached prefix of `seq`, in whole blocks, leaving at least one token to
        compute (the last token's logits are needed)."""
        if not self.enable_caching:
            return []
        self.update_hashes(seq)
        if self._drops:
            self._apply_drops()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in seq.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.host is not None and len(hits) < max_blocks:
            hits += self._copy_in(self.host, seq, hits, max_blocks)
        return hits

    # -- the host tier -----------------------------------------------------------------------
    def _offload(self, block: KVBlock) -> None:
        if self.host is not None and block.tag is not None:
            self.host.store(block.block_hash, block.tag, block.block_id)   # type: ignore[arg-type]

    def _copy_in(self, host: HostKVTier, seq: Sequence, hits: list[KVBlock], max_blocks: int) -> list[KVBlock]:
        """The blocks after `hits` that the host tier holds, copied into fresh device blocks
        (at the step's flush) and cached there, as if the device had kept them; none where
        recomputing them is cheaper."""
        pool, bs = self.pool, self.block_size
        start = len(hits)
        hashes, end = seq.block_hashes, start
        while end < max_blocks and hashes[end] in host and hashes[end] not in pool.cached:
            end += 1
        host.num_queries += (max_blocks - start) * bs
        wanted = hashes[start:end]
        n = host.count_run(wanted)          # each marked recently used
        if n == 0 or not host.worth_copying(n, self.recompute_s(n * bs, start * bs)):
            return []
        tiers = [b.tier for b in hits]
        pool.touch(hits)                     # making room must not evict the device's own hits
        fresh = pool.allocate(min(n, pool.num_free_blocks)) or []
        out, tag = [], self._tag(seq)
        for block, block_hash in zip(fresh, wanted, strict=False):
            if not host.load(block_hash, block.block_id):   # evicted meanwhile: the run ends
                break
            pool.cache_block(block, block_hash, tag)
            out.append(block)
        for block, tier in zip(hits, tiers, strict=True):
            pool.free([block], tier)
        # cached and free, like any device hit: the caller adopts them
        rank_tier = len(pool.free_queues) - 1 - seq.state.class_rank
        pool.free(reversed(out), rank_tier)
        pool.free(reversed(fresh[len(out):]))
        host.num_hits += len(out) * bs
        return out

    def flush_host_tier(self) -> None:
        """The host tier's copies recorded while scheduling: done before the forward."""
        if self.host is not None:
            self.host.flush()

    def drop_later(self, match: Callable[[Tag], bool]) -> None:
        """Forget, in both tiers, the cached blocks whose (model, adapter id, scope) tag
        matches, before the next lookup. Safe from any thread (a list append)."""
        self._drops.append(match)

    def drop_adapter(self, adapter_id: int) -> None:
        """An adapter was removed: a later one under its id may have other weights."""
        self.drop_later(lambda tag: tag[1] == adapter_id)

    def drop_tenant(self, tenant: str) -> None:
        """A tenant was deleted: its own blocks (not a share group's) leave both tiers."""
        self.drop_later(lambda tag: tag[2] == f"t:{tenant}")

    def _apply_drops(self) -> None:
        while self._drops:      # pop, not swap: another thread may append meanwhile
            match = self._drops.pop(0)
            self.pool.uncache(match)
            if self.host is not None:
                self.host.drop(match)

    def record_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one admitted sequence's prefix lookup (for the hit-rate stats)."""
        self.num_cache_queries += num_tokens
        self.num_cache_hits += num_cached_tokens

    # -- allocation ------------------------------------------------------------------------
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_shared: int = 0) -> int:
        held = len(self.tables.get(id(seq), ())) + num_shared
        return max(0, cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - held)

    def try_allocate(
        self, seq: Sequence, num_new_tokens: int, shared: list[KVBlock] | None = None,
        reserve: int = 0,
    ) -> bool:
        """Give `seq` blocks for `num_new_tokens` more tokens past its computed ones.

        `shared` are filled blocks (a prefix hit, or a sibling's prompt) that the sequence
        adopts first; its `num_computed_tokens` must already count them. `reserve` blocks
        must stay free afterwards (kept for more urgent classes). All or nothing.
        """
        shared = shared or []
        num_new_blocks = self.num_blocks_needed(seq, num_new_tokens, len(shared))
        num_revived = sum(1 for b in shared if b.ref_cnt == 0) if shared else 0  # free blocks a hit takes back
        # most calls (a decode within its last block, no reserve) need nothing: the free
        # count, a sum over the pool's queues, is then not asked
        need = num_new_blocks + num_revived + reserve
        if need and need > self.pool.num_free_blocks:
            return False
        table = self.tables.setdefault(id(seq), [])
        ids = self.ids.setdefault(id(seq), [])
        if shared:
            self.pool.touch(shared)
            table.extend(shared)
            ids.extend(b.block_id for b in shared)
        if num_new_blocks:
            new = self._allocate_contiguous(seq, table, num_new_blocks)
            table.extend(new)
            ids.extend(b.block_id for b in new)
        return True

    def _allocate_contiguous(self, seq: Sequence, table: list[KVBlock], num: int) -> list[KVBlock]:
        """`num` fresh blocks, consecutive with `table` where the pool allows (see
        block_pool's docstring for why); the caller has checked that `num` are free."""
        pool, owner = self.pool, id(seq)
        max_tokens = seq.params.max_tokens
        if max_tokens is None:       # to the end of the context: reserve the most we may
            want = num + self.max_reserve_blocks
        else:                        # the blocks it still expects to fill, this step's included
            expected = cdiv(seq.num_prompt_tokens + max_tokens, self.block_size) - len(table)
            want = min(max(num, expected), num + self.max_reserve_blocks)
        new = pool.allocate_next(table[-1].block_id, num, owner, want) if table else []
        if len(new) < num:           # no room after its last block: a run of its own
            pool.unreserve(owner)
            rest, room = num - len(new), want - len(new)
            more = pool.allocate_run(rest, room, owner)
            new += more or (pool.allocate_run(rest, rest, owner) if room > rest else [])
        if len(new) < num:           # no free run: any free blocks (attention gathers them)
            scattered = pool.allocate(num - len(new))
            if scattered is None:
                raise RuntimeError(f"KV cache: {num} free blocks were checked, fewer are free")
            new += scattered
        return new

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` that is full of computed tokens in the prefix cache."""
        if not self.enable_caching:
            return
        # computed tokens not yet appended (a draft's accepted ones) wait for the next call
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        done = self.num_registered.get(id(seq), 0)
        if num_full <= done:
            return
        self.update_hashes(seq)
        table = self.tables[id(seq)]
        tag = self._tag(seq)
        for i in range(done, num_full):     # only blocks filled since the last call
            if table[i].block_hash is None:
                self.pool.cache_block(table[i], seq.block_hashes[i], tag)
        self.num_registered[id(seq)] = num_full

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks `seq`'s first `num_tokens` tokens need; the slots past them
        (the rejected tokens of a draft) are released, and blocks left empty go back to the
        pool (uncached, reused first; a block of `seq`'s reservation stays reserved for it).
        A kept block that is only partly filled is never in the prefix cache: only blocks
        full of computed tokens are registered (`cache_full_blocks`)."""
        keep = cdiv(num_tokens, self.block_size)
        table = self.tables.get(id(seq))
        if table is None or len(table) <= keep:
            return
        if self.num_registered.get(id(seq), 0) > keep:
            raise RuntimeError(f"{seq}: truncating to {num_tokens} tokens would drop cached blocks")
        dropped = table[keep:]
        if any(b.ref_cnt != 1 or b.block_hash is not None for b in dropped):
            raise RuntimeError(f"{seq}: a block past {num_tokens} tokens is shared or cached")
        del table[keep:]
        del self.ids[id(seq)][keep:]
        self.pool.free(reversed(dropped))

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; cached ones keep their contents in the eviction tier of
        its class (the least urgent class is evicted first)."""
        self.num_registered.pop(id(seq), None)
        table = self.tables.pop(id(seq), None)
        self.ids.pop(id(seq), None)
        if table:
            tier = len(self.pool.free_queues) - 1 - seq.state.class_rank
            self.pool.free(reversed(table), tier)
        self.pool.unreserve(id(seq))

    # -- accounting ------------------------------------------------------------------------
    def stats(self) -> KVStats:
        pool, host = self.pool, self.host
        out = KVStats(total=pool.num_blocks, used=pool.num_used_blocks, free=pool.num_free_blocks,
                      prefix_cache_queries=self.num_cache_queries, prefix_cache_hits=self.num_cache_hits,
                      device_evictions=pool.num_evictions)
        if host is not None:
            out.host_total, out.host_held = host.num_slots, host.num_held
            out.host_queries, out.host_hits = host.num_queries, host.num_hits
            out.host_copy_ins, out.host_stores = host.num_copy_ins, host.num_stores
            out.host_evictions = host.num_evictions
        return out

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for key, table in self.tables.items():
            if self.ids.get(key) != [b.block_id for b in table]:
                raise AssertionError("a sequence's block ids disagree with its blocks")
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        if not set(self.pool.extents) <= set(self.tables):
            raise AssertionError("a reservation outlived its sequence")
        for block in self.pool.blocks:
            if refs.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(
                    f"{block}: held by {refs.get(block.block_id, 0)} tables, ref count {block.ref_cnt}"
                )
