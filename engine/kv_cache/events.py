"""KV events: what a worker's prefix cache stored, removed or cleared, for the pool's router.

The block pool calls a listener when a block's hash enters its prefix map (`BlockStored`),
leaves it (`BlockRemoved`: evicted, or the block reused) and when the whole map goes
(`AllCleared`: the model offloaded, ranks rebuilt). Hashes are the engine's own chained
digests, salted by model, adapter, tenant (or share group) and cache salt, so another
tenant's index entry never matches. `tier` names the memory that holds the block ("device";
a host tier reports "host").

A worker's `KVEventLog` batches what its engines emitted since the last cut into an
`EventBatch` with a sequence number, and keeps the last `keep` batches so a caller that
missed one gets it again. A caller further behind (a gap, or a worker that restarted: the
log's `epoch` changed) is sent a snapshot of every cached hash instead; applying the
batches after a snapshot's sequence number in order is then exact, because every change to
the cache after the snapshot was taken is in a later batch (the listener runs after the
change, under the log's lock).
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

DEVICE = "device"


@dataclass(frozen=True, slots=True)
class BlockStored:
    hashes: tuple[bytes, ...]
    model: str = ""
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    hashes: tuple[bytes, ...]
    model: str = ""
    tier: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllCleared:
    """Every block of `model` on `tier` is gone (other models' blocks on the worker stay)."""

    model: str = ""
    tier: str = DEVICE


KVEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    events: tuple[KVEvent, ...]


@dataclass(frozen=True, slots=True)
class EventReport:
    """What a report carries: the batches after the caller's sequence number, or (`snapshot`
    not None) every cached hash by (model, tier) as of `seq`, then the batches after it."""

    epoch: str
    seq: int                                   # the newest batch's number
    batches: tuple[EventBatch, ...] = ()
    snapshot: dict[tuple[str, str], frozenset[bytes]] | None = field(default=None, repr=False)


# what the block pool calls: ("stored" | "removed" | "cleared", the block's hash or None)
Listener = Callable[[str, bytes | None], None]


class KVEventLog:
    """A worker's events, batched and kept for its callers. Thread-safe: engines emit from
    their step threads, reports read from the worker's loop."""

    def __init__(self, keep: int = 256, max_pending: int = 200_000) -> None:
        """`keep`: batches kept for callers behind; `max_pending`: events held uncut (no caller
        asked for a while) before they are dropped for a new epoch (every caller then gets a
        snapshot): memory stays bounded whoever reads."""
        self.max_pending = max_pending
        self.epoch = secrets.token_hex(8)      # a restarted worker's log is another one
        self.seq = 0
        self._pending: list[KVEvent] = []
        self._batches: deque[EventBatch] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._sources: dict[tuple[str, str], Callable[[], Iterable[bytes]]] = {}
        self.emitted = 0

    def listener(self, model: str, cached: Callable[[], Iterable[bytes]], tier: str = DEVICE) -> Listener:
        """The listener for one model's block pool (or its host tier, `tier="host"`);
        `cached()` lists the hashes it holds (for a snapshot)."""
        self._sources[(model, tier)] = cached

        def on_event(kind: str, block_hash: bytes | None) -> None:
            if kind == "stored" and block_hash is not None:
                event: KVEvent = BlockStored((block_hash,), model, tier)
            elif kind == "removed" and block_hash is not None:
                event = BlockRemoved((block_hash,), model, tier)
            else:
                event = AllCleared(model, tier)
            with self._lock:
                self._pending.append(event)
                self.emitted += 1
                if len(self._pending) > self.max_pending:
                    self._pending.clear()
                    self._batches.clear()
                    self.epoch = secrets.token_hex(8)

        return on_event

    def _cut(self) -> None:
        """The pending events into one batch (runs of one kind merged; caller holds the lock)."""
        if not self._pending:
            return
        merged: list[KVEvent] = []
        for e in self._pending:
            last = merged[-1] if merged else None
            if (isinstance(e, BlockStored | BlockRemoved) and type(last) is type(e)
                    and last.model == e.model and last.tier == e.tier):
                merged[-1] = type(e)(last.hashes + e.hashes, e.model, e.tier)
            else:
                merged.append(e)
        self._pending = []
        self.seq += 1
        self._batches.append(EventBatch(self.seq, tuple(merged)))

    def report(self, epoch: str | None, after: int) -> EventReport:
        """What a caller that applied this log's batches up to `after` (of log `epoch`) needs."""
        with self._lock:
            self._cut()
            oldest = self._batches[0].seq if self._batches else self.seq + 1
            if epoch == self.epoch and after >= oldest - 1:
                return EventReport(self.epoch, self.seq, tuple(b for b in self._batches if b.seq > after))
            return EventReport(self.epoch, self.seq, (), self.cached())

    def cached(self) -> dict[tuple[str, str], frozenset[bytes]]:
        """Every hash cached now, by (model, tier)."""
        # list() of a dict's keys runs without releasing the GIL: a consistent copy
        return {key: frozenset(list(src())) for key, src in self._sources.items()}
