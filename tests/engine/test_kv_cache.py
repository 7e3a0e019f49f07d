"""Block pool and KV manager on their own: free queue, reference counts, hash chains, LRU."""

from __future__ import annotations

import pytest

from lockgate.engine.kv_cache import BlockPool, FreeBlockQueue, KVBlock, KVCacheManager, hash_block
from lockgate.engine.request import EngineRequest, RequestState, Sequence
from lockgate.engine.sampling_params import SamplingParams


def test_free_queue_removes_from_the_middle_in_constant_time():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [2, 0, 1, 3] and q.num_free == 4
    assert q.popleft() is blocks[2]
    with pytest.raises(ValueError):
        q.remove(blocks[4])
    with pytest.raises(ValueError):
        q.append(blocks[0])     # already queued


def test_pool_refcounts_double_free_and_eviction_order():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and pool.allocate(2) is None   # all or nothing
    for i, b in enumerate(a):
        pool.cache_block(b, bytes([i]) * 32)
    pool.touch([a[0]])                      # shared by a second holder
    pool.free(reversed(a))                  # tail first: a[2] is the LRU head now
    assert a[0].ref_cnt == 1 and pool.num_free_blocks == 3
    # the never-cached free block goes first, then cached ones, tail of the prefix first
    order = [b.block_id for b in pool.free_queue]
    assert order == [3, a[2].block_id, a[1].block_id]
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [3, a[2].block_id]
    assert pool.get_cached_block(bytes([2]) * 32) is None        # evicted
    assert pool.get_cached_block(bytes([1]) * 32) is a[1]        # still cached, still free
    pool.free(got)
    pool.free([a[0]])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])
    pool.check_integrity()


def seq_of(tokens, salt=None, model=None, max_tokens=16):
    req = EngineRequest("r", tokens, SamplingParams(max_tokens=max_tokens), cache_salt=salt, model=model)
    state = RequestState(req=req, class_rank=0)
    seq = Sequence(state, 0, list(tokens), len(tokens))
    state.seqs.append(seq)
    return seq


def test_hash_chain_depends_on_the_whole_prefix_salt_and_model():
    kv = KVCacheManager(16, 4)
    a, b = seq_of(list(range(12))), seq_of([99, *range(1, 12)])
    kv.update_hashes(a)
    kv.update_hashes(b)
    assert len(a.block_hashes) == 3
    # same tokens in block 1 and 2, but the first block differs: every hash differs
    assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes, strict=True))
    for other in (seq_of(list(range(12)), salt="s"), seq_of(list(range(12)), model="lora-1")):
        kv.update_hashes(other)
        assert other.block_hashes[0] != a.block_hashes[0]
    assert hash_block(None, [1, 2], b"") == hash_block(None, [1, 2], b"")


def test_manager_allocates_exactly_what_tokens_need_and_shares_hits():
    kv = KVCacheManager(8, 4)
    a = seq_of(list(range(10)))
    assert kv.try_allocate(a, 10) and len(kv.blocks_of(a)) == 3     # ceil(10 / 4)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)                                         # blocks 0 and 1 are full
    b = seq_of([*range(8), 50, 51, 52])
    hits = kv.get_computed_blocks(b)
    assert hits == kv.blocks_of(a)[:2]
    b.num_computed_tokens = 8
    assert kv.try_allocate(b, 3, hits) and [x.ref_cnt for x in hits] == [2, 2]
    assert kv.num_used_blocks == 4
    assert not kv.try_allocate(seq_of([7] * 40), 40)                # needs 10 > 4 free: nothing taken
    assert kv.num_used_blocks == 4
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def seq_with(tokens, max_tokens):
    return seq_of(tokens, max_tokens=max_tokens)


def test_sequences_get_consecutive_blocks_and_room_to_grow():
    """A new sequence starts a free run long enough for prompt + max_tokens and reserves
    the rest, so another sequence placed meanwhile does not land in its way; it grows into
    the reservation; freeing releases it."""
    kv = KVCacheManager(32, 4)
    a = seq_with(list(range(12)), max_tokens=4)        # 16 tokens: 4 blocks expected
    assert kv.try_allocate(a, 6)                        # a first chunk of its prompt
    assert kv.block_ids(a) == [0, 1]                    # blocks 2, 3 reserved for a
    b = seq_with(list(range(100, 105)), max_tokens=3)  # 8 tokens: 2 blocks
    assert kv.try_allocate(b, 5) and kv.block_ids(b) == [4, 5]
    a.num_computed_tokens = 6
    assert kv.try_allocate(a, 5) and kv.block_ids(a) == [0, 1, 2]    # grows in place
    # a prefix hit on a's first block: block 1 after it is a's, so the hitter's own
    # blocks start a run of their own
    a.num_computed_tokens = 11
    kv.cache_full_blocks(a)
    c = seq_with([*range(4), 7, 7, 7], max_tokens=8)
    hits = kv.get_computed_blocks(c)
    assert [x.block_id for x in hits] == [0]
    c.num_computed_tokens = 4
    assert kv.try_allocate(c, 3, hits)
    assert kv.block_ids(c)[0] == 0 and kv.block_ids(c)[1] not in (1, 2, 3, 4, 5)
    kv.check_integrity()
    kv.free(a)
    kv.free(b)
    kv.free(c)
    kv.check_integrity()
    assert not kv.pool.extents and kv.num_free_blocks == 32


def test_reservations_are_soft_and_fall_back_to_any_free_block():
    """Reserved blocks count as free: when only they are left, a sequence takes them, and
    its owner then grows wherever blocks are free. Nothing is refused for contiguity."""
    kv = KVCacheManager(8, 4)
    a = seq_with([1] * 4, max_tokens=28)            # 32 tokens: the whole pool reserved
    assert kv.try_allocate(a, 4) and kv.block_ids(a) == [0]
    assert kv.num_free_blocks == 7
    b = seq_with([2] * 12, max_tokens=1)            # needs 3 blocks: no free run left
    assert kv.try_allocate(b, 12) and len(kv.block_ids(b)) == 3
    a.num_computed_tokens = 4
    assert kv.try_allocate(a, 8) and len(kv.block_ids(a)) == 3
    assert not set(kv.block_ids(a)) & set(kv.block_ids(b))
    kv.check_integrity()
    kv.free(b)
    kv.free(a)
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_a_hit_on_a_cached_prefix_continues_right_after_it_when_the_next_block_is_clean():
    kv = KVCacheManager(32, 4)
    a = seq_with(list(range(9)), max_tokens=1)      # blocks 0, 1 full; 2 partly
    assert kv.try_allocate(a, 9) and kv.block_ids(a) == [0, 1, 2]
    a.num_computed_tokens = 9
    kv.cache_full_blocks(a)
    kv.free(a)                                      # 0, 1 stay cached; 2 is clean again
    b = seq_with([*range(8), 50, 51, 52], max_tokens=9)   # 20 tokens: 5 blocks
    hits = kv.get_computed_blocks(b)
    b.num_computed_tokens = 8
    assert kv.try_allocate(b, 3, hits)
    assert kv.block_ids(b) == [0, 1, 2]             # one run: attention reads it as a view
    other = seq_with([9] * 4, max_tokens=1)
    assert kv.try_allocate(other, 4) and kv.block_ids(other)[0] >= 5   # 3, 4 are b's room
    b.num_computed_tokens = 11
    assert kv.try_allocate(b, 9) and kv.block_ids(b) == [0, 1, 2, 3, 4]
    kv.check_integrity()


def test_once_every_free_block_holds_a_cached_prefix_runs_start_at_the_eviction_head():
    """No clean run is left: a new sequence's run starts at the next block to evict, its
    cached prefixes are evicted, and the rest of the pool's cache stays."""
    kv = KVCacheManager(8, 4)
    seqs = []
    for i in range(2):                                  # two prompts of 4 full blocks each
        s = seq_with([i * 100 + t for t in range(16)], max_tokens=1)
        assert kv.try_allocate(s, 16)
        s.num_computed_tokens = 16
        kv.cache_full_blocks(s)
        seqs.append(s)
    first_ids = kv.block_ids(seqs[0])
    for s in seqs:
        kv.free(s)
    assert not kv.pool.clean.count(1)                   # every free block is cached
    new = seq_with([7] * 8, max_tokens=8)               # 16 tokens: a run of 4 blocks
    assert kv.try_allocate(new, 8)
    ids = kv.block_ids(new)
    assert ids == first_ids[:2]                         # the oldest request's run, evicted
    assert kv.pool.extents[id(new)] == (first_ids[2], first_ids[3] + 1)
    assert kv.get_computed_blocks(seq_with([100 + t for t in range(16)] + [1], 1))  # 2nd prompt still cached
    kv.check_integrity()
    kv.free(new)
    kv.check_integrity()


def test_a_token_within_the_last_block_takes_no_block_yet_honours_the_reserve():
    """The decode fast path: a token that fits the sequence's last block allocates nothing,
    and is still refused (nothing changed) while fewer than `reserve` blocks are free."""
    kv = KVCacheManager(4, 4)
    a = seq_of(list(range(6)))
    assert kv.try_allocate(a, 6) and len(kv.blocks_of(a)) == 2
    a.num_computed_tokens = 6
    free = kv.num_free_blocks
    assert kv.try_allocate(a, 1) and kv.try_allocate(a, 2)          # 7, 8 tokens: still 2 blocks
    assert len(kv.blocks_of(a)) == 2 and kv.num_free_blocks == free
    assert not kv.try_allocate(a, 1, reserve=free + 1)              # the reserve is not there
    assert kv.try_allocate(a, 1, reserve=free)
    assert len(kv.blocks_of(a)) == 2 and kv.num_free_blocks == free
    assert kv.try_allocate(a, 3) and len(kv.blocks_of(a)) == 3      # 9 tokens: a third block
    kv.free(a)
    kv.check_integrity()
    assert kv.num_free_blocks == 4


def test_truncate_releases_the_slots_past_the_kept_tokens():
    """Blocks of 4. A 6-token prompt computed, its first token sampled (7 tokens); a decode
    with 5 draft tokens computes positions 6..11: 12 slots, 3 blocks. It keeps 2 drafts: 9
    tokens computed, still 3 blocks; the 2 drafts and the token after them make 10 tokens,
    blocks 0 and 1 full and cached. The next decode carries 6 drafts (16 slots, a 4th block)
    and keeps none: truncated to 10 tokens, the 4th block goes back to the pool uncached and
    the partly filled 3rd stays out of the prefix cache."""
    kv = KVCacheManager(8, 4)
    seq = seq_of(range(10, 16), max_tokens=100)
    assert kv.try_allocate(seq, 6)
    seq.num_computed_tokens = 6
    seq.token_ids.append(1)
    assert kv.try_allocate(seq, 1 + 5) and len(kv.blocks_of(seq)) == 3
    seq.num_computed_tokens += 1 + 2
    kv.truncate(seq, seq.num_computed_tokens)
    assert len(kv.blocks_of(seq)) == 3
    seq.token_ids += [2, 3, 4]
    kv.cache_full_blocks(seq)
    assert kv.try_allocate(seq, 1 + 6) and len(kv.blocks_of(seq)) == 4
    fourth = kv.blocks_of(seq)[3]
    seq.num_computed_tokens += 1
    kv.truncate(seq, seq.num_computed_tokens)
    kv.cache_full_blocks(seq)
    assert kv.block_ids(seq) == [b.block_id for b in kv.blocks_of(seq)] and len(kv.blocks_of(seq)) == 3
    assert fourth.ref_cnt == 0 and fourth.block_hash is None
    assert [b.block_hash is not None for b in kv.blocks_of(seq)] == [True, True, False]
    assert kv.num_free_blocks == 5
    kv.check_integrity()
    with pytest.raises(RuntimeError, match="cached"):
        kv.truncate(seq, 4)               # would drop block 1, which is in the prefix cache
    kv.free(seq)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_a_run_at_the_eviction_head_never_reaches_into_a_recently_used_prefix():
    """The run found at the eviction head may evict only blocks that are next in line
    anyway: a tenant's prefix freed a moment ago that lies beside the oldest block stays
    cached, and the run is taken further down the line instead."""
    pool = BlockPool(16)
    blocks = pool.allocate(16)
    assert blocks is not None
    for b in blocks:
        pool.cache_block(b, bytes([b.block_id]))
    by_id = {b.block_id: b for b in blocks}
    pool.free([by_id[3], by_id[2]])                       # the oldest request's (0, 1 still held)
    pool.free([by_id[i] for i in range(15, 7, -1)])       # then others'
    pool.free([by_id[i] for i in range(7, 3, -1)])        # a shared prefix, used last
    assert [b.block_id for b in pool.free_queue][:3] == [3, 2, 15]
    got = pool.allocate_run(2, 4, owner=1)
    assert [b.block_id for b in got] == [12, 13]          # (before: 3, 4, evicting the prefix)
    assert all(pool.get_cached_block(bytes([i])) is by_id[i] for i in range(4, 8))
    assert pool.get_cached_block(bytes([12])) is None and pool.get_cached_block(bytes([3])) is not None
    pool.check_integrity()
