"""`KVIndex`: the router's precise record of which prefix blocks each worker's cache holds, per
tier, fed by the workers' KV events (engine/kv_cache/events.py) on their reports.

A worker's entry is trusted ("fresh") once a snapshot of its cache was applied, as long as
its batches arrive in sequence and its last report is recent; a gap in the sequence, a
changed epoch (the worker restarted) or silence marks it stale until the next snapshot,
and the router then falls back to its approximate path for that worker (engine/pool/router.py).

`engine_chain` computes a prompt's block hashes as the engine's KV manager does
(engine/kv_cache/manager.py `hash_block` over the same length-prefixed salt), so the
router can ask the index how many leading blocks a worker holds before sending it anything.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from lockgate.engine.kv_cache.events import AllCleared, BlockRemoved, BlockStored, EventReport
from lockgate.engine.kv_cache.manager import block_salt, cache_scope, hash_block


def engine_salt(model: str, tenant: str, cache_salt: str | None, share_group: str | None = None,
                variant: str = "") -> bytes:
    """The engine's per-block salt (KVCacheManager._extra_key) for a request of `model`."""
    return block_salt(model, variant, cache_scope(tenant, share_group), cache_salt)


def engine_chain(salt: bytes, ids: Sequence[int], block_size: int, max_blocks: int = 256) -> list[bytes]:
    """The engine's hashes of the prompt's leading full blocks (at most `max_blocks`), leaving
    out the block of its last token, which the engine always computes."""
    out: list[bytes] = []
    parent: bytes | None = None
    for k in range(min((len(ids) - 1) // block_size if ids else 0, max_blocks)):
        parent = hash_block(parent, list(ids[k * block_size:(k + 1) * block_size]), salt)
        out.append(parent)
    return out


@dataclass
class WorkerEntry:
    epoch: str | None = None
    seq: int = -1                     # the last batch applied (-1: no snapshot yet)
    at: float = 0.0                   # when its last report was applied (monotonic)
    held: dict[str, dict[bytes, str]] = field(default_factory=dict)   # tier -> hash -> model
    gaps: int = 0
    snapshots: int = 0


class KVIndex:
    def __init__(self, max_age_s: float = 5.0) -> None:
        """`max_age_s`: a worker whose events are older than this is not trusted."""
        self.max_age_s = max_age_s
        self.workers: dict[str, WorkerEntry] = {}

    def cursor(self, worker: str) -> tuple[str | None, int]:
        """(epoch, last batch) to ask `worker`'s log for what follows."""
        e = self.workers.get(worker)
        return (e.epoch, e.seq) if e is not None else (None, -1)

    def apply(self, worker: str, rep: EventReport) -> None:
        e = self.workers.setdefault(worker, WorkerEntry())
        if rep.snapshot is not None:
            e.held = {}
            for (model, tier), hashes in rep.snapshot.items():
                e.held.setdefault(tier, {}).update(dict.fromkeys(hashes, model))
            e.epoch, e.seq = rep.epoch, rep.seq
            e.snapshots += 1
        elif rep.epoch != e.epoch:
            self.forget(worker)               # restarted: wait for its snapshot
            return
        for batch in rep.batches:
            if batch.seq <= e.seq:
                continue
            if batch.seq != e.seq + 1:        # a gap: stale until a snapshot
                e.gaps += 1
                e.seq, e.epoch = -1, None
                return
            for ev in batch.events:
                held = e.held.setdefault(ev.tier, {})
                if isinstance(ev, BlockStored):
                    held.update(dict.fromkeys(ev.hashes, ev.model))
                elif isinstance(ev, BlockRemoved):
                    for h in ev.hashes:
                        held.pop(h, None)
                elif isinstance(ev, AllCleared):
                    for h in [h for h, m in held.items() if m == ev.model]:
                        del held[h]
            e.seq = batch.seq
        e.at = time.monotonic()

    def forget(self, worker: str) -> None:
        e = self.workers.get(worker)
        if e is not None:
            e.held, e.seq, e.epoch = {}, -1, None

    def fresh(self, worker: str) -> bool:
        e = self.workers.get(worker)
        return e is not None and e.seq >= 0 and time.monotonic() - e.at <= self.max_age_s

    def hashes(self, worker: str, tier: str = "device") -> set[bytes]:
        e = self.workers.get(worker)
        return set(e.held.get(tier, ())) if e is not None else set()

    def match(self, worker: str, chain: Sequence[bytes]) -> int:
        """Leading blocks of `chain` held by `worker` on any tier."""
        e = self.workers.get(worker)
        if e is None:
            return 0
        tiers = list(e.held.values())
        n = 0
        for h in chain:
            if not any(h in t for t in tiers):
                break
            n += 1
        return n

    def size(self) -> int:
        return sum(len(t) for e in self.workers.values() for t in e.held.values())

    def staleness_s(self, worker: str) -> float | None:
        """Seconds since `worker`'s events were last applied (None: never, or a gap)."""
        e = self.workers.get(worker)
        if e is None or e.seq < 0:
            return None
        return time.monotonic() - e.at
