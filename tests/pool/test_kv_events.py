"""KV events through the protocol in process: real KV managers (allocation, prefix hits,
evictions, resets), their event logs, and the router's index fed only by reports."""

from __future__ import annotations

import random

from lockgate.engine.kv_cache import KVCacheManager
from lockgate.engine.kv_cache.events import BlockStored, EventReport, KVEventLog
from lockgate.engine.pool.kv_index import KVIndex, engine_chain, engine_salt
from lockgate.engine.request import EngineRequest, RequestState, Sequence
from lockgate.engine.sampling_params import SamplingParams

BS = 4


def seq_of(tokens: list[int], tenant: str, model: str = "m", salt: str | None = None) -> Sequence:
    req = EngineRequest("r", tokens, SamplingParams(max_tokens=4), tenant=tenant, model=model, cache_salt=salt)
    state = RequestState(req=req, class_rank=0)
    seq = Sequence(state, 0, list(tokens), len(tokens))
    state.seqs.append(seq)
    return seq


def worker(model: str = "m", blocks: int = 48, keep: int = 256) -> tuple[KVCacheManager, KVEventLog]:
    kv = KVCacheManager(blocks, BS)
    log = KVEventLog(keep=keep)
    kv.pool.listener = log.listener(model, lambda: kv.pool.cached)
    return kv, log


def run_request(kv: KVCacheManager, live: list[Sequence], seq: Sequence) -> None:
    """Admit `seq` as the scheduler would: its cached prefix shared, the rest allocated
    (freeing the oldest live sequences while it does not fit), computed, registered."""
    hits = kv.get_computed_blocks(seq)
    seq.num_computed_tokens = len(hits) * BS
    while not kv.try_allocate(seq, seq.num_tokens - seq.num_computed_tokens, shared=hits):
        kv.free(live.pop(0))
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)
    live.append(seq)
    if len(live) > 3:
        kv.free(live.pop(0))


def test_engine_chain_is_the_managers_own_hashing():
    kv, _ = worker()
    ids = list(range(37))
    seq = seq_of(ids, "acme", salt="s")
    kv.update_hashes(seq)
    chain = engine_chain(engine_salt("m", "acme", "s"), ids, BS)
    assert chain == seq.block_hashes[:(len(ids) - 1) // BS]
    assert engine_chain(engine_salt("m", "other", "s"), ids, BS)[0] != chain[0]


def test_index_equals_every_workers_cache_after_10000_random_requests():
    rng = random.Random(7)  # noqa: S311 - a reproducible workload
    names = ["w0", "w1", "w2"]
    # a short log on w2: a caller that falls behind it is sent a snapshot
    workers = {n: worker(keep=256 if n != "w2" else 3) for n in names}
    live: dict[str, list[Sequence]] = {n: [] for n in names}
    index = KVIndex(max_age_s=3600)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((8, 16, 24)))] for _ in range(12)]
    dropped = resets = snapshots_forced = 0
    for _ in range(10_000):
        n = rng.choice(names)
        kv = workers[n][0]
        tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        run_request(kv, live[n], seq_of(tokens, f"t{rng.randrange(4)}"))
        if rng.random() < 0.002:            # the model offloaded: every block gone
            while live[n]:
                kv.free(live[n].pop())
            kv.reset()
            resets += 1
        if rng.random() < 0.15:             # a report round to one worker
            r = rng.choice(names)
            rep = workers[r][1].report(*index.cursor(r))
            if rng.random() < 0.03 and rep.batches:       # a batch lost on the way: a gap
                rep = EventReport(rep.epoch, rep.seq, rep.batches[1:], rep.snapshot)
                dropped += 1
            elif rng.random() < (0.7 if r == "w2" else 0.05):   # the whole report lost
                continue
            index.apply(r, rep)
            if not index.fresh(r):           # the gap seen: a snapshot on the next round
                index.apply(r, workers[r][1].report(*index.cursor(r)))
                snapshots_forced += 1
    for n in names:
        index.apply(n, workers[n][1].report(*index.cursor(n)))
        kv = workers[n][0]
        assert index.fresh(n)
        assert index.hashes(n) == set(kv.pool.cached), n
        assert kv.pool.num_evictions > 100                  # evictions did happen
    assert resets and dropped and snapshots_forced
    assert index.workers["w2"].snapshots > 1                # it fell behind its short log


def test_index_answers_how_many_leading_blocks_a_worker_holds_per_tenant():
    kv, log = worker()
    index = KVIndex()
    ids = list(range(40))
    run_request(kv, [], seq_of(ids, "acme"))
    index.apply("w", log.report(*index.cursor("w")))
    assert index.match("w", engine_chain(engine_salt("m", "acme", None), ids, BS)) == 9
    assert index.match("w", engine_chain(engine_salt("m", "acme", None), ids[:20] + [7] * 20, BS)) == 5
    assert index.match("w", engine_chain(engine_salt("m", "rival", None), ids, BS)) == 0
    assert index.match("w", engine_chain(engine_salt("other", "acme", None), ids, BS)) == 0


def test_a_restarted_worker_is_stale_until_its_snapshot():
    kv, log = worker()
    index = KVIndex()
    run_request(kv, [], seq_of(list(range(20)), "acme"))
    index.apply("w", log.report(*index.cursor("w")))
    assert index.fresh("w") and index.hashes("w")
    _, log2 = worker()                         # a new process: another epoch, empty cache
    stale = EventReport(log2.epoch, 1, ())
    index.apply("w", stale)
    assert not index.fresh("w") and not index.hashes("w")
    index.apply("w", log2.report(*index.cursor("w")))
    assert index.fresh("w") and index.hashes("w") == set()


def test_batches_merge_runs_of_one_kind():
    kv, log = worker()
    run_request(kv, [], seq_of(list(range(20)), "acme"))
    rep = log.report(None, -1)
    assert rep.snapshot is not None and len(rep.snapshot[("m", "device")]) == 5
    rep = log.report(rep.epoch, 0)
    assert len(rep.batches) == 1 and rep.batches[0].events == (
        BlockStored(tuple(kv.pool.cached), "m", "device"),)


def test_a_log_nobody_reads_stays_bounded_and_sends_a_snapshot_after():
    kv = KVCacheManager(48, BS)
    log = KVEventLog(max_pending=10)
    kv.pool.listener = log.listener("m", lambda: kv.pool.cached)
    index = KVIndex()
    index.apply("w", log.report(*index.cursor("w")))
    live: list[Sequence] = []
    for i in range(20):
        run_request(kv, live, seq_of([i] * 20, "acme"))
    assert len(log._pending) <= 10
    rep = log.report(*index.cursor("w"))
    assert rep.snapshot is not None                  # a new epoch: the caller starts again
    index.apply("w", rep)
    assert index.fresh("w") and index.hashes("w") == set(kv.pool.cached)


def test_a_host_tiers_blocks_reach_the_index_as_tier_host():
    """A worker whose device cache evicts into a host tier: after random requests (and a
    snapshot for a caller that starts late), the index's host view is the tier's entries and
    its device view the block pool's."""
    import torch

    from lockgate.engine.kv_cache.device_cache import DeviceKVCache
    from lockgate.engine.kv_cache.host_tier import HostKVTier

    dev = DeviceKVCache(1, 1, 2, torch.float32, torch.device("cpu"))
    dev.allocate(24, BS)
    kv = KVCacheManager(24, BS, host_tier=HostKVTier(dev, 40, BS))
    log = KVEventLog()
    kv.pool.listener = log.listener("m", lambda: kv.pool.cached)
    kv.host.listener = log.listener("m", lambda: kv.host.entries, tier="host")
    rng = random.Random(3)  # noqa: S311 - a reproducible workload
    index, late, live = KVIndex(), KVIndex(), []
    for i in range(400):
        run_request(kv, live, seq_of([rng.randrange(6) for _ in range(rng.randrange(5, 30))], f"t{i % 3}"))
        kv.host.flush()
        if i % 7 == 0:
            index.apply("w", log.report(*index.cursor("w")))
    for ix in (index, late):
        ix.apply("w", log.report(*ix.cursor("w")))
        assert set(ix.workers["w"].held["device"]) == set(kv.pool.cached)
        assert set(ix.workers["w"].held["host"]) == set(kv.host.entries) and kv.host.num_held > 10
    assert late.workers["w"].snapshots == 1
