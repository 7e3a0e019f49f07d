"""The compile cache, bounded in bytes as well as entries, and per tenant.

Each entry is a spec's compile future, charged to the tenant that first asked for it (its
owner) at an estimate of what the compiled grammar holds: a base, the grammar's text, and
its first mask's CPU time (llguidance's lexer grows about 400 MB a CPU second while it
expands; `LEXER_FUEL` caps that at `MAX_ENTRY_BYTES`). A compile still running is charged
the base and its text, re-charged when done.

Bounds, enforced on every insert and re-charge:
- an owner past its share (`tenant_share` of the bytes and of the entries) loses its own
  least recently used entries, never anyone else's;
- past the whole cache's bytes or entries, the owner holding the most loses its least
  recently used entry, so one tenant's distinct specs cannot push out everyone else's.
An evicted future stays valid for whoever holds it (its requests run); the cache merely
forgets it.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
Key = tuple[str, str]

ENTRY_BASE_BYTES = 64 << 10
GRAMMAR_CHAR_BYTES = 64                 # a grammar's text, as llguidance's grammar and lexer spec
BYTES_PER_MASK_CPU_S = 400 << 20
MAX_ENTRY_BYTES = 48 << 20


def charge(grammar_chars: int, first_mask_s: float = 0.0) -> int:
    """The bytes an entry is charged: see the module's docstring."""
    return min(ENTRY_BASE_BYTES + GRAMMAR_CHAR_BYTES * grammar_chars + int(first_mask_s * BYTES_PER_MASK_CPU_S),
               MAX_ENTRY_BYTES)


@dataclass(slots=True)
class _Entry(Generic[T]):
    future: Future[T]
    owner: str
    bytes: int


class GrammarCache(Generic[T]):
    def __init__(self, max_bytes: int, max_entries: int, tenant_share: float) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.tenant_share = tenant_share
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, _Entry[T]] = OrderedDict()
        self._bytes: Counter[str] = Counter()
        self._count: Counter[str] = Counter()
        self.total_bytes = 0

    def get_or_start(self, key: Key, start: Callable[[], Future[T]], owner: str,
                     nbytes: int) -> tuple[Future[T], bool]:
        """The cached future of `key`, or one `start` makes, cached, charged to `owner`;
        and whether it is new. (`start` runs under the lock: one compile per key.)"""
        with self._lock:
            if (entry := self._entries.get(key)) is not None:
                self._entries.move_to_end(key)
                return entry.future, False
            future = start()
            self._entries[key] = _Entry(future, owner, 0)
            self._count[owner] += 1
            self._set_bytes(key, nbytes)
            self._evict(owner)
            return future, True

    def recharge(self, key: Key, future: Future[T], nbytes: int) -> None:
        """The entry's charge, now that its compile is done (if it is still cached)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.future is future:
                self._set_bytes(key, nbytes)
                self._evict(entry.owner)

    def bytes_of(self, owner: str) -> int:
        return self._bytes[owner]

    def num_entries(self, owner: str | None = None) -> int:
        return len(self._entries) if owner is None else self._count[owner]

    def _set_bytes(self, key: Key, nbytes: int) -> None:
        entry = self._entries[key]
        self._bytes[entry.owner] += nbytes - entry.bytes
        self.total_bytes += nbytes - entry.bytes
        entry.bytes = nbytes

    def _drop(self, key: Key) -> None:
        entry = self._entries.pop(key)
        self._bytes[entry.owner] -= entry.bytes
        self._count[entry.owner] -= 1
        self.total_bytes -= entry.bytes
        if not self._count[entry.owner]:
            del self._count[entry.owner], self._bytes[entry.owner]

    def _oldest_of(self, owner: str) -> Key:
        return next(k for k, e in self._entries.items() if e.owner == owner)

    def _evict(self, owner: str) -> None:
        share_bytes = self.max_bytes * self.tenant_share
        share_entries = max(1, int(self.max_entries * self.tenant_share))
        while self._count[owner] and (self._bytes[owner] > share_bytes or self._count[owner] > share_entries):
            self._drop(self._oldest_of(owner))
        while self._entries and (self.total_bytes > self.max_bytes or len(self._entries) > self.max_entries):
            biggest = max(self._bytes, key=lambda o: (self._bytes[o], self._count[o]))
            self._drop(self._oldest_of(biggest))
