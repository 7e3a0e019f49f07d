"""`Router`: which worker takes a request, in the gateway replica (no Ray here).

Among the workers placement assigned the request's model (or an adapter's base): the one most
likely to hold the longest cached prefix of this tenant's prompt, unless it is much busier
than the least loaded; otherwise the least loaded for the request's class (ties broken in
turn). Prefix affinity is remembered here, per replica, as the engine's prefix cache is keyed:
a chain of hashes over full blocks of the prompt, salted by model, tenant and cache salt (so
tenants never share), mapped to the worker that last computed it (bounded, least recently
used first out). It approximates the workers' caches the way SGLang's router does, without a
round trip; a worker that evicted a prefix costs one recomputation, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence

BLOCK = 16              # tokens per hashed block (the engine's default block size)
MAX_BLOCKS = 64         # at most this many leading blocks are hashed (1,024 tokens)


def prefix_chain(salt: str, ids: Sequence[int], block: int = BLOCK,
                 max_blocks: int = MAX_BLOCKS) -> list[bytes]:
    """Chained digests of the prompt's leading full blocks: entry k stands for tokens
    [0, (k + 1) * block), under `salt`."""
    out: list[bytes] = []
    h = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    for k in range(min(len(ids) // block, max_blocks)):
        chunk = ids[k * block:(k + 1) * block]
        h = hashlib.blake2b(h + b"".join(int(t).to_bytes(4, "little", signed=True) for t in chunk),
                            digest_size=16).digest()
        out.append(h)
    return out


class Router:
    """Chooses a worker per request and remembers where prefixes went."""

    def __init__(self, *, capacity: int = 100_000, slack: int = 4) -> None:
        """`capacity`: prefix entries remembered. `slack`: the affinity worker is taken unless
        its load exceeds the least loaded worker's by more than this many requests."""
        self.capacity = capacity
        self.slack = slack
        self._where: OrderedDict[bytes, str] = OrderedDict()
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[str], load: Callable[[str], int],
               chain: Sequence[bytes]) -> tuple[str, int]:
        """(worker, cached blocks expected there) for a request whose prefix chain is `chain`,
        among `candidates` (non-empty), `load(worker)` the work ahead of it there."""
        if not candidates:
            raise ValueError("candidates: no worker serves this model")
        loads = {w: load(w) for w in candidates}
        least = min(loads.values())
        best, depth = None, 0
        for k in range(len(chain) - 1, -1, -1):          # the longest remembered prefix
            w = self._where.get(chain[k])
            if w in loads:
                best, depth = w, k + 1
                break
        if best is not None and loads[best] <= least + self.slack:
            choice = best
        else:
            tied = sorted(w for w, v in loads.items() if v == least)
            choice, depth = tied[next(self._turn) % len(tied)], 0
        self.remember(chain, choice)
        return choice, depth

    def remember(self, chain: Sequence[bytes], worker: str) -> None:
        for h in chain:
            self._where[h] = worker
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget_worker(self, worker: str) -> None:
        """A worker restarted (its cache is empty): its prefixes are forgotten."""
        for h in [h for h, w in self._where.items() if w == worker]:
            del self._where[h]
