"""`Router`: which worker takes a request, in the gateway replica (no Ray here).

Among the workers placement assigned the request's model (or an adapter's base): the one most
likely to hold the longest cached prefix of this tenant's prompt, unless it is much busier
than the least loaded; otherwise the least loaded for the request's class (ties broken in
turn). Prefixes are keyed as the engine's prefix cache is: a chain of hashes over full blocks
of the prompt, salted by model, tenant and cache salt (so tenants never share).

Two sources say where a prefix is, both approximations of the workers' caches, as SGLang's
router keeps one: this replica's own routing decisions (bounded, least recently used first
out; fresh, no round trip), and each worker's `PrefixSummary`, which the worker keeps of the
prompts it accepted (bounded by its KV cache's blocks, least recently used first out) and
sends with its report, so that a prefix computed for one gateway replica is found by every
other. A worker that evicted a prefix costs one recomputation, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
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


def hint_key(salt: str, hint: str) -> bytes:
    """The routing key of a request's cache hint (OpenAI's `prompt_cache_key`) under `salt`
    (model, tenant, cache salt): requests that share it go where it went before, even when
    their prompts share less than a block, or differ in their first block; another tenant's
    same hint is another key."""
    return hashlib.blake2b(b"hint\0" + salt.encode() + b"\0" + hint.encode(), digest_size=16).digest()


def request_chain(model: str, tenant: str, cache_salt: str | None, ids: Sequence[int],
                  hint: str | None = None) -> list[bytes]:
    """A request's routing chain: its prompt's prefix chain salted as the engine's cache is
    (model, tenant, cache salt), led by its hint's key when it has one."""
    salt = f"{model}\0{tenant}\0{cache_salt or ''}"
    return ([hint_key(salt, hint)] if hint else []) + prefix_chain(salt, ids)


SUMMARY_KEY = 8        # bytes of each chain digest a worker's summary keeps


class PrefixSummary:
    """A worker's compact record of the prompt prefixes it holds: the leading `SUMMARY_KEY`
    bytes of each chain digest of the prompts it accepted, at most `capacity` of them (one per
    cached block; least recently used first out, as the engine's cache evicts). `version`
    moves whenever the set changes, so a report sends it only then."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        # versions start at random: a restarted worker's never match what a replica holds
        self.version = secrets.randbits(48)

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, chain: Sequence[bytes]) -> None:
        changed = False
        for h in chain:
            key = h[:SUMMARY_KEY]
            if key in self._keys:
                self._keys.move_to_end(key)
            else:
                self._keys[key] = None
                changed = True
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        if changed:
            self.version += 1

    def clear(self) -> None:
        if self._keys:
            self._keys.clear()
            self.version += 1

    def packed(self) -> bytes:
        """The keys, concatenated: what a report carries (8 bytes a block)."""
        return b"".join(self._keys)


def unpack_summary(blob: bytes) -> frozenset[bytes]:
    return frozenset(blob[i:i + SUMMARY_KEY] for i in range(0, len(blob), SUMMARY_KEY))


class Router:
    """Chooses a worker per request and remembers where prefixes went."""

    def __init__(self, *, capacity: int = 100_000, slack: int = 4) -> None:
        """`capacity`: prefix entries remembered. `slack`: the affinity worker is taken unless
        its load exceeds the least loaded worker's by more than this many requests."""
        self.capacity = capacity
        self.slack = slack
        self._where: OrderedDict[bytes, str] = OrderedDict()
        self._turn = itertools.count()
        self.summaries: dict[str, frozenset[bytes]] = {}    # worker -> its PrefixSummary keys

    def set_summary(self, worker: str, keys: frozenset[bytes]) -> None:
        """The prefixes `worker` reported holding (replacing what it reported before)."""
        self.summaries[worker] = keys

    def _holder(self, digest: bytes, loads: dict[str, int]) -> str | None:
        """A candidate said to hold this prefix: this replica's own memory first, else the
        least loaded worker whose summary has it."""
        w = self._where.get(digest)
        if w in loads:
            return w
        key = digest[:SUMMARY_KEY]
        holders = [w for w in loads if key in self.summaries.get(w, ())]
        return min(holders, key=lambda w: (loads[w], w)) if holders else None

    def choose(self, candidates: Sequence[str], load: Callable[[str], int],
               chain: Sequence[bytes]) -> tuple[str, int]:
        """(worker, cached blocks expected there) for a request whose prefix chain is `chain`,
        among `candidates` (non-empty), `load(worker)` the work ahead of it there."""
        if not candidates:
            raise ValueError("candidates: no worker serves this model")
        loads = {w: load(w) for w in candidates}
        least = min(loads.values())
        best, depth = None, 0
        for k in range(len(chain) - 1, -1, -1):          # the longest prefix held
            w = self._holder(chain[k], loads)
            if w is not None:
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
        self.summaries.pop(worker, None)
