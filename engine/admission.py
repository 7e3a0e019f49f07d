"""Bounded queues: which arrivals `AsyncEngine` takes, which it refuses, which queued work it
sheds to make room.

A request counts as *queued* from `submit` until it sends its first output (or ends): work
the engine has promised but not yet begun to answer. The bound is what the queued work
costs, not how many requests it is: its tokens, prompt plus `max_tokens` of each, over all
queued work together (default: twice what the KV cache holds, or what the step-cost model
says the engine computes in `QUEUE_HORIZON_S` at full steps, whichever is more, and never
more than `QUEUE_KV_MAX` times the KV cache: memory and time). A count of requests would
refuse a library user's batch of short offline requests that fits many times over;
refusing background work early is the gateway's decision (its flex tier,
gateway/serving/tiers.py). An explicit `max_waiting_tokens` replaces the token bound; an
explicit `max_waiting_per_class` also bounds the count of each class on its own.

An arrival into an empty queue is always taken (a request larger than the token bound
would otherwise never be). An arrival past a bound sheds queued work of less urgent
classes, least urgent class first and newest first within it, if that makes room;
otherwise it is refused. So the least urgent class is refused first, and a more urgent
arrival is never refused while less urgent work it could replace is queued. Only requests
submitted `sheddable` are ever shed (the gateway submits streams, whose 200 went out at
once, as not sheddable), and only while they have sent nothing. Not thread-safe: `AsyncEngine` calls it under its lock.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from lockgate.engine.errors import EngineOverloaded
from lockgate.engine.stats import OverloadStats, QueueBounds

QUEUE_HORIZON_S = 30.0     # queued tokens worth this long of full steps, by the cost model
# ...but never more than this many times what the KV cache holds: a cost model fitted on
# decode steps alone extrapolates a full prefill step to almost nothing, and its rate to a
# bound that bounds nothing
QUEUE_KV_MAX = 16


@dataclass(slots=True)
class Queued:
    request_id: str
    service_class: str
    rank: int
    tenant: str
    tokens: int
    sheddable: bool


class Admission:
    def __init__(self, classes: tuple[str, ...], *, max_waiting_per_class: int | None,
                 max_waiting_tokens: int | None) -> None:
        self.classes = classes
        self.rank = {c: i for i, c in enumerate(classes)}
        self.per_class_bound = max_waiting_per_class
        self.count_bound = max_waiting_per_class * len(classes) if max_waiting_per_class else None
        self.explicit_tokens = max_waiting_tokens
        self.token_bound = max_waiting_tokens or (1 << 62)   # until the engine is sized
        self.tokens_per_s: float | None = None
        self.queued: dict[str, Queued] = {}      # insertion order = arrival order
        self.count_by_class: Counter[str] = Counter()
        self.tokens = 0
        self.refused: dict[str, Counter[str]] = {c: Counter() for c in classes}
        self.shed: dict[str, Counter[str]] = {c: Counter() for c in classes}

    def size(self, kv_tokens: int, tokens_per_s: float | None) -> None:
        """The derived token bound, from the KV cache's capacity and the cost model's rate."""
        self.tokens_per_s = tokens_per_s
        if self.explicit_tokens is None:
            horizon = int(tokens_per_s * QUEUE_HORIZON_S) if tokens_per_s else 0
            self.token_bound = max(2 * kv_tokens, min(horizon, QUEUE_KV_MAX * kv_tokens))

    def retry_after(self) -> float:
        """Seconds until the queue has likely drained enough (by the cost model's rate)."""
        if not self.tokens_per_s:
            return 1.0
        return float(min(60, max(1, math.ceil(self.tokens / self.tokens_per_s))))

    def admit(self, q: Queued) -> list[Queued]:
        """Take `q` into the queue, returning the queued requests shed to make room (already
        forgotten here; the caller aborts them), or raise EngineOverloaded."""
        cls = q.service_class
        if self.per_class_bound is not None and self.count_by_class[cls] >= self.per_class_bound:
            self._refuse(q, f"{self.per_class_bound} requests of class {cls!r} already waiting")
        over_count = len(self.queued) + 1 - self.count_bound if self.count_bound else 0
        over_tokens = self.tokens + q.tokens - self.token_bound
        victims: list[Queued] = []
        if self.queued and (over_count > 0 or over_tokens > 0):   # alone, anything is taken
            for v in reversed(self._candidates(q.rank)):
                if over_count <= 0 and over_tokens <= 0:
                    break
                victims.append(v)
                over_count -= 1
                over_tokens -= v.tokens
            if over_count > 0 or over_tokens > 0:
                what = (f"{len(self.queued)} requests" if over_count > 0
                        else f"{self.tokens} tokens (a bound of {self.token_bound})")
                self._refuse(q, f"{what} already waiting, none of them less urgent than {cls!r} "
                                "that could make room")
        for v in victims:
            self.forget(v.request_id)
        self.queued[q.request_id] = q
        self.count_by_class[cls] += 1
        self.tokens += q.tokens
        return victims

    def _candidates(self, rank: int) -> list[Queued]:
        """Sheddable queued requests of classes less urgent than `rank`, most urgent class
        first and oldest first (so the end of the list is what goes first)."""
        out = [v for v in self.queued.values() if v.rank > rank and v.sheddable]
        out.sort(key=lambda v: v.rank)    # stable: arrival order kept within a class
        return out

    def _refuse(self, q: Queued, why: str) -> None:
        self.refused[q.service_class][q.tenant] += 1
        raise EngineOverloaded(f"service_class {q.service_class!r}: {why}",
                               service_class=q.service_class, retry_after=self.retry_after())

    def count_shed(self, victim: Queued) -> None:
        """The caller did shed `victim` (one that got going in the meantime is not shed)."""
        self.shed[victim.service_class][victim.tenant] += 1

    def forget(self, request_id: str) -> Queued | None:
        """The request sent its first output or ended: no longer queued."""
        q = self.queued.pop(request_id, None)
        if q is not None:
            self.count_by_class[q.service_class] -= 1
            self.tokens -= q.tokens
        return q

    def stats(self) -> OverloadStats:
        return OverloadStats(
            queued={c: self.count_by_class[c] for c in self.classes},
            queued_tokens=self.tokens,
            bounds=QueueBounds(self.count_bound, self.token_bound, self.per_class_bound),
            refused={c: dict(n) for c, n in self.refused.items()},
            shed={c: dict(n) for c, n in self.shed.items()},
            drain_s=self.tokens / self.tokens_per_s if self.tokens_per_s else None,
        )
