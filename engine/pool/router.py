"""`Router`: which worker takes a request, in the gateway replica (no Ray here).

Among the workers placement assigned the request's model (or an adapter's base), each is
scored by the prefill its cache would save the request against the queue it would wait in,
both in seconds from that worker's fitted step-cost model (`Router` says how), under a cap
on how far one worker's requests in flight may run ahead of the least loaded's.

Where a prefix is cached comes first from the pool's `KVIndex` (engine/pool/kv_index.py),
fed by the workers' own KV events: exact while a worker's events arrive in sequence. For a
worker whose events are late (a gap, a restart, silence) and for adapters' requests (their
hashes are salted by the adapter's id on that worker), two approximations stand in, as
SGLang's router keeps one: this replica's own routing decisions (bounded, least recently
used first out; fresh, no round trip), and each worker's `PrefixSummary`, which the worker
keeps of the prompts it accepted (bounded by its KV cache's blocks) and sends with its
report, so that a prefix computed for one gateway replica is found by every other. Their
chains are keyed as the engine's cache is: hashes over full blocks of the prompt, salted by
model, tenant and cache salt (so tenants never share). A worker that evicted a prefix costs
one recomputation, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Price:
    """A worker's step-cost model as routing reads it (engine/cost_model.py): seconds per prompt
    token computed, per sequence in a step (its share of every step it is in), and a step's
    fixed cost (what a request arriving at a busy worker waits, half of on average)."""

    token_s: float
    request_s: float
    step_s: float = 0.0


# what a worker with no fitted cost model yet costs when no other worker's is fitted either:
# only ratios matter then, all workers priced alike
DEFAULT_PRICE = Price(token_s=1e-4, request_s=1e-3, step_s=5e-3)
# (weight of the prefill seconds a cached prefix saves, weight of the seconds queued ahead):
# an online request goes where its own time to first token (the queue ahead, then its own
# prefill) is least; offline work is paid in compute, so saving it weighs more
CLASS_WEIGHTS = {"online": (1.0, 1.0), "offline": (1.5, 0.5)}
CAP_RATIO, CAP_SLACK = 2, 3      # in flight on a worker at most CAP_RATIO x the least loaded's + CAP_SLACK


def price_of(coefficients: dict[str, float] | None, prompt_tokens: int) -> Price | None:
    """A fitted cost model's price of a `prompt_tokens` prompt (None: not fitted): a token's
    share of the step's prefill and attention (a token attends to half the prompt on average),
    a sequence's of its per-sequence and sampling costs, a step's fixed cost."""
    if not coefficients:
        return None
    c = coefficients.get
    token = c("prefill_tokens", 0.0) + c("prefill_attention", 0.0) * prompt_tokens / 2
    return Price(token_s=max(token, 1e-9), request_s=c("seqs", 0.0) + c("sampled", 0.0),
                 step_s=c("const", 0.0))


def priced_alike(prices: dict[str, Price | None]) -> dict[str, Price]:
    """Each worker's price; an unfitted one priced as the median fitted one (else the default),
    so that a fresh worker neither attracts nor repels work for want of a fit."""
    fitted = [p for p in prices.values() if p is not None]
    if fitted:
        mid = len(fitted) // 2
        token = sorted(p.token_s for p in fitted)[mid]
        request = sorted(p.request_s for p in fitted)[mid]
        fallback = Price(token, request, sorted(p.step_s for p in fitted)[mid])
    else:
        fallback = DEFAULT_PRICE
    return {w: p if p is not None else fallback for w, p in prices.items()}


class Router:
    """Chooses a worker per request and remembers where prefixes went.

    Each candidate's score, in seconds: the prefill its cache would save this request (its
    cached prefix tokens, from the pool's KV index where that worker's events are fresh,
    else from the approximate record below, times its price of a token), less the cost of
    the work queued ahead of the request there (requests ahead x a request's price), each
    weighted by the request's class (`CLASS_WEIGHTS`). A worker with more than `CAP_RATIO`
    x + `CAP_SLACK` the least loaded worker's requests in flight is not a candidate: one
    hot prefix never piles up on one worker. Scores within one request's price of the best
    tie; ties go to the most cached, then the least loaded, in turn."""

    def __init__(self, *, capacity: int = 100_000, recent_s: float = 2.0) -> None:
        """`capacity`: prefix entries remembered. `recent_s`: how long a prefix this replica
        routed counts as held by its worker even where that worker's events are fresh (its
        prefill may not have run yet, so no event can say so)."""
        self.capacity = capacity
        self.recent_s = recent_s
        # prefix -> the workers this replica sent it to, each with when (a hot prefix on several)
        self._where: OrderedDict[bytes, dict[str, float]] = OrderedDict()
        self._turn = itertools.count()
        self.summaries: dict[str, frozenset[bytes]] = {}    # worker -> its PrefixSummary keys
        self.chosen: Counter[str] = Counter()                 # how each choice was priced

    def set_summary(self, worker: str, keys: frozenset[bytes]) -> None:
        """The prefixes `worker` reported holding (replacing what it reported before)."""
        self.summaries[worker] = keys

    def _approx_depth(self, worker: str, chain: Sequence[bytes], recent: bool = False) -> int:
        """Leading blocks of `chain` this replica routed to `worker` or its summary holds;
        `recent`: only what this replica routed there in the last `recent_s`."""
        keys = frozenset() if recent else self.summaries.get(worker, frozenset())
        since = time.monotonic() - self.recent_s if recent else -1.0
        for k in range(len(chain) - 1, -1, -1):
            if self._where.get(chain[k], {}).get(worker, -2.0) >= since or chain[k][:SUMMARY_KEY] in keys:
                return k + 1
        return 0

    def choose(self, candidates: Sequence[str], load: Callable[[str], int],
               chain: Sequence[bytes], *, cached: Callable[[str], int | None] | None = None,
               prices: dict[str, Price] | None = None, inflight: Callable[[str], int] | None = None,
               pending: Callable[[str], int] | None = None, service_class: str = "online",
               prompt_tokens: int | None = None) -> tuple[str, int]:
        """(worker, cached blocks of `chain` expected there) for a request whose prefix chain is
        `chain`, among `candidates` (non-empty). `load(worker)`: the requests ahead of it
        there; `cached(worker)`: prompt tokens the worker's cache holds, None where its index
        is stale (the approximate record then); `prices`: each worker's (default: alike);
        `inflight(worker)`: for the cap (default: its load); `pending(worker)`: prompt tokens
        queued there to compute (default: half this prompt's per request ahead)."""
        if not candidates:
            raise ValueError("candidates: no worker serves this model")
        loads = {w: load(w) for w in candidates}
        busy = {w: inflight(w) for w in candidates} if inflight is not None else loads
        least = min(busy.values())
        allowed = [w for w in candidates if busy[w] <= CAP_RATIO * least + CAP_SLACK]
        n = prompt_tokens if prompt_tokens is not None else len(chain) * BLOCK
        saved_w, queue_w = CLASS_WEIGHTS.get(service_class, CLASS_WEIGHTS["online"])
        scores: dict[str, float] = {}
        held: dict[str, int] = {}
        for w in allowed:
            tokens = cached(w) if cached is not None else None
            depth = self._approx_depth(w, chain, recent=tokens is not None)
            if tokens is not None:       # what its events cannot show yet: routed, not computed
                tokens = max(tokens, depth * BLOCK)
            held[w] = depth if tokens is None else tokens // BLOCK
            tokens = min(n, depth * BLOCK if tokens is None else tokens)
            p = (prices or {}).get(w, DEFAULT_PRICE)
            ahead = pending(w) if pending is not None else loads[w] * n // 2
            queue = loads[w] * p.request_s + ahead * p.token_s + (p.step_s / 2 if loads[w] else 0.0)
            scores[w] = saved_w * tokens * p.token_s - queue_w * queue
        # scores within one request's share of a step are the cost model's noise: among them
        # the most compute saved, then the least loaded
        top = max(scores.values())
        noise = min(p.request_s + p.step_s / 2 for p in ((prices or {}).get(w, DEFAULT_PRICE) for w in allowed))
        best = [w for w in allowed if scores[w] >= top - noise - 1e-12]
        most = max(held[w] for w in best)
        best = [w for w in best if held[w] == most]
        low = min(loads[w] for w in best)
        tied = sorted(w for w in best if loads[w] == low)
        choice = tied[next(self._turn) % len(tied)] if len(tied) > 1 else tied[0]
        self.chosen["cached" if held[choice] else "uncached"] += 1
        self.remember(chain, choice)
        return choice, held[choice]

    def remember(self, chain: Sequence[bytes], worker: str) -> None:
        now = time.monotonic()
        for h in chain:
            self._where.setdefault(h, {})[worker] = now
            self._where.move_to_end(h)
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def forget_worker(self, worker: str) -> None:
        """A worker restarted (its cache is empty): its prefixes are forgotten."""
        for h in [h for h, ws in self._where.items() if worker in ws]:
            del self._where[h][worker]
            if not self._where[h]:
                del self._where[h]
        self.summaries.pop(worker, None)
