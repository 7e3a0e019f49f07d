"""Whom a waiting sequence may preempt when the running set has no room for it (no
sequence slot, or no blocks), under the `priority` policy (engine/scheduler.py).

Two rules, tried in this order:

- Urgency: a running sequence of a less urgent class, the least urgent first (its class,
  then its tenant's fairness counter, priority and arrival: the scheduler's key).
- The tenant floor: inside one class, fairness orders who goes next, but a running
  sequence keeps its slot until it ends; so a tenant holding every slot with long requests
  would make the others wait for those requests to end. A waiting sequence whose tenant
  holds no running sequence of its class may therefore preempt the newest running sequence
  of the tenant holding the most of that class, as long as that tenant keeps at least one.
  Once the waiting tenant holds a slot the rule no longer applies to it, so it takes one
  slot at a time and the heaviest tenant never loses its last: nothing thrashes. The
  victim's blocks are freed and its tokens recomputed later (its cached prefix kept), so
  its output is the same as had it never been preempted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from lockgate.engine.request import Sequence


def room_victim(running: list[Sequence], seq: Sequence, key: Callable[[Sequence], tuple]) -> Sequence | None:
    """The running sequence to preempt to make room for waiting `seq`; None if none may be."""
    rank = seq.state.class_rank
    less_urgent = [s for s in running if s.state.class_rank > rank]
    if less_urgent:
        return max(less_urgent, key=key)
    return floor_victim(running, seq)


def floor_victim(running: list[Sequence], seq: Sequence) -> Sequence | None:
    """The tenant floor: the newest running sequence of the tenant that holds the most of
    `seq`'s class, if `seq`'s tenant holds none there and that tenant holds two or more."""
    rank, tenant = seq.state.class_rank, seq.state.req.tenant
    same = [s for s in running if s.state.class_rank == rank]
    held = Counter(s.state.req.tenant for s in same)
    if held[tenant] or not held:
        return None
    heaviest, num = max(held.items(), key=lambda kv: (kv[1], kv[0]))
    if num < 2:
        return None
    return max((s for s in same if s.state.req.tenant == heaviest),
               key=lambda s: (s.state.arrival_seq, s.index))
