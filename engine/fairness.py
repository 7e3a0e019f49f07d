"""Tenant fairness inside a service class: virtual token counters (VTC, OSDI'24) per
(class, tenant), and the service each tenant got (`TenantStats`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

PREFILL_COST = 1   # service per uncached prompt token computed
DECODE_COST = 2    # service per output token (VTC's w_q)


class Fairness:
    """Virtual token counters per (class, tenant): service / weight.

    A tenant is active in a class while it has sequences there (waiting or running). A
    tenant that becomes active starts at the least counter among the active tenants of its
    class (or at the class's high-water mark when none is), so idle time banks no credit.
    """

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = weights if weights is not None else {}
        self.counters: dict[int, dict[str, float]] = defaultdict(dict)
        self.active: dict[int, dict[str, int]] = defaultdict(dict)
        self.high_water: dict[int, float] = defaultdict(float)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, rank: int, tenant: str) -> float:
        return self.counters[rank].get(tenant, 0.0)

    def activate(self, rank: int, tenant: str, num: int = 1) -> None:
        active = self.active[rank]
        if active.get(tenant, 0) == 0:
            others = [self.counters[rank].get(t, 0.0) for t, n in active.items() if n > 0]
            floor = min(others) if others else self.high_water[rank]
            self.counters[rank][tenant] = max(self.counter(rank, tenant), floor)
        active[tenant] = active.get(tenant, 0) + num

    def deactivate(self, rank: int, tenant: str) -> None:
        active = self.active[rank]
        active[tenant] -= 1
        if active[tenant] <= 0:
            del active[tenant]

    def charge(self, rank: int, tenant: str, service: float) -> None:
        c = self.counter(rank, tenant) + service / self.weight(tenant)
        self.counters[rank][tenant] = c
        if c > self.high_water[rank]:
            self.high_water[rank] = c

    def backlogged(self, rank: int) -> dict[str, float]:
        """Counters of the tenants active in class `rank`."""
        return {t: self.counter(rank, t) for t, n in self.active[rank].items() if n > 0}


@dataclass(slots=True)
class TenantStats:
    preemptions: int = 0
    prefill_tokens: int = 0     # computed (uncached) prompt tokens, recomputation included
    decode_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens served from the prefix cache at admission
