"""`Placement`: which workers serve which model, decided pool-wide by demand (no Ray here;
`engine.pool.remote_worker.PlacementActor` holds one per pool so that every gateway replica
sees the same decisions).

Each worker can keep `capacity` models resident at once (its memory budget over the models'
sizes: every model of the pool is configured on every worker, whose `ModelPool` brings them
in and out). The rules, online demand first:

- a model that is asked for and has no worker is placed on the worker where the switch costs
  least: one with a free place, else the one whose least-demanded model is coldest (that
  model loses the place);
- a hot model (more than `hot_per_worker` requests waiting or running per worker serving it)
  gets one more worker with a free place;
- a model with no demand for `cold_s` gives up its places beyond its first, and its first
  too when another model needs the place;
- no model's set of workers changes more than once per `min_turn_s` (the `ModelPool`'s own
  turn and drain rules keep a single worker from thrashing).

Every change is kept with its reason (`decisions`), which `/admin/v1/engine` shows.

A worker may be a tensor-parallel group: it holds `tensor_parallel_size` devices (Ray's
`lockgate_device` units, all on one node: its ranks are processes beside it) and is placed,
routed to and reported as one worker; `pool_workers` counts how many the cluster's devices hold.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


class DevicesShort(ValueError):
    """The cluster lends fewer devices than the pool's workers need."""


def pool_workers(node_devices: list[int], tensor_parallel_size: int, asked: int | None) -> int:
    """How many workers the pool starts: `asked`, or as many groups of `tensor_parallel_size`
    devices as the nodes' devices hold (`node_devices`: each node's; a group never spans
    nodes). One when no node advertises devices (a worker on the CPU then takes none).
    Refused when they do not fit, rather than actors left pending."""
    tp = max(1, tensor_parallel_size)
    devices = sum(node_devices)
    if devices <= 0:
        return asked or 1
    fit = sum(d // tp for d in node_devices)
    n = asked or fit
    if n < 1 or n > fit:
        raise DevicesShort(
            f"the cluster lends {devices} lockgate_device unit(s) on {len(node_devices)} node(s) "
            f"({', '.join(map(str, node_devices))}); {max(n, 1)} worker(s) of tensor_parallel_size {tp} "
            f"need {max(n, 1) * tp} on nodes of {tp} or more (at most {fit} worker(s) fit)")
    return n


@dataclass
class Decision:
    at: float
    model: str
    worker: str
    action: str          # "place" or "remove"
    reason: str


@dataclass
class Placement:
    workers: list[str]
    capacity: dict[str, int]                               # worker -> models it holds at once
    hot_per_worker: int = 8
    cold_s: float = 60.0
    min_turn_s: float = 5.0
    assigned: dict[str, list[str]] = field(default_factory=dict)      # model -> workers
    decisions: deque[Decision] = field(default_factory=lambda: deque(maxlen=200))
    _last_demand: dict[str, float] = field(default_factory=dict)
    _last_change: dict[str, float] = field(default_factory=dict)

    def held(self, worker: str) -> list[str]:
        return [m for m, ws in self.assigned.items() if worker in ws]

    def free(self, worker: str) -> int:
        return self.capacity.get(worker, 1) - len(self.held(worker))

    def _note(self, now: float, model: str, worker: str, action: str, reason: str) -> None:
        self.decisions.append(Decision(now, model, worker, action, reason))
        self._last_change[model] = now

    def _place(self, model: str, worker: str, now: float, reason: str) -> None:
        self.assigned.setdefault(model, []).append(worker)
        self._note(now, model, worker, "place", reason)

    def _remove(self, model: str, worker: str, now: float, reason: str) -> None:
        self.assigned[model].remove(worker)
        self._note(now, model, worker, "remove", reason)

    def workers_for(self, model: str, demand: dict[str, int], now: float | None = None) -> list[str]:
        """The workers serving `model`, placing it first if it has none (`demand`: requests
        waiting or running per model, pool-wide, as the gateway last saw them)."""
        now = time.time() if now is None else now
        if not self.assigned.get(model):
            self._bring_in(model, demand, now)
        return list(self.assigned.get(model, []))

    def _bring_in(self, model: str, demand: dict[str, int], now: float) -> None:
        spare = [w for w in self.workers if self.free(w) > 0]
        if spare:
            w = max(spare, key=lambda w: (self.free(w), -self.workers.index(w)))
            self._place(model, w, now, "asked for; a free place")
            return
        # every place is taken: evict the coldest model that has another worker, else the
        # coldest of all (least demand, longest unasked)
        def coldness(m: str) -> tuple[int, int, float]:
            return (len(self.assigned[m]) == 1, demand.get(m, 0), self._last_demand.get(m, 0.0))
        victims = sorted((m for m in self.assigned if self.assigned[m]), key=coldness)
        if not victims:
            return
        victim = victims[0]
        w = self.assigned[victim][-1]
        self._remove(victim, w, now, f"gave its place to {model} (demand {demand.get(victim, 0)})")
        self._place(model, w, now, f"asked for; took the place of {victim}, the coldest")

    def rebalance(self, demand: dict[str, int], now: float | None = None) -> None:
        """Apply the hot and cold rules once (called on every demand report)."""
        now = time.time() if now is None else now
        for m, d in demand.items():
            if d > 0:
                self._last_demand[m] = now
        for m, ws in self.assigned.items():
            if not ws or now - self._last_change.get(m, 0.0) < self.min_turn_s:
                continue
            d = demand.get(m, 0)
            if d > self.hot_per_worker * len(ws):
                spare = [w for w in self.workers if w not in ws and self.free(w) > 0]
                if spare:
                    self._place(m, spare[0], now, f"hot: {d} requests on {len(ws)} worker(s)")
            elif d == 0 and len(ws) > 1 and now - self._last_demand.get(m, 0.0) > self.cold_s:
                self._remove(m, ws[-1], now, f"cold: no demand for {self.cold_s:g} s")

    def snapshot(self) -> dict:
        return {"assigned": {m: list(ws) for m, ws in self.assigned.items()},
                "capacity": dict(self.capacity),
                "decisions": [vars(d) for d in list(self.decisions)[-50:]]}
