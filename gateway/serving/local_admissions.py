"""What one replica knows of its own admissions, checked before the shared limiter is asked,
so a burst meets its own limits here and never piles onto the event loop and Redis.

- `LocalAdmissions` is `AppState.inflight` (request id -> the lease it holds, heart-beaten):
  it also counts the leases by limit scope, and the admissions under way (a request that
  arrived and holds no lease yet: waiting for the limiter, or a small body read before it).
- `check` refuses, before any limiter call: a tenant's (or key's) request when its requests on
  this replica alone already reach its `max_concurrent_requests` (a 429 as the limiter's; the
  shared count can only be higher, so the limiter would refuse too, but for requests here
  still under way, which are counted as if admitted: a burst's, conservatively); then any
  request while `max_admissions_in_flight` admissions are under way on the replica (503
  `server_busy`, with Retry-After: the replica's capacity, not the tenant's limit).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from lockgate.gateway.errors import APIError
from lockgate.tenancy.limiter import Decision, Lease, LimitScope
from lockgate.tenancy.limiter.base import CONC, CONCURRENCY_RETRY_HINT
from lockgate.tenancy.limiter.decision import Refusal, decide
from lockgate.tenancy.limiter.periods import Periods

_MISSING: Any = object()


class LocalAdmissions(dict[str, Lease]):
    """Request id -> lease, counted by scope key as leases come and go (`[]=`, `pop`, `del`,
    `clear`, `update`, `setdefault`), with the admissions under way (`start`/`end`)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: Counter[str] = Counter()         # scope key -> leases held on this replica
        self.pending: Counter[str] = Counter()      # scope key -> admissions under way
        self.under_way = 0                          # admissions under way, whoever's

    def _count(self, scopes: Iterable[LimitScope], into: Counter[str], n: int) -> None:
        for scope in scopes:
            into[scope.key] += n
            if into[scope.key] <= 0:
                del into[scope.key]

    def __setitem__(self, request_id: str, lease: Lease) -> None:
        old = dict.get(self, request_id)
        if old is not None:
            self._count(old.scopes, self.held, -1)
        super().__setitem__(request_id, lease)
        self._count(lease.scopes, self.held, 1)

    def __delitem__(self, request_id: str) -> None:
        lease = self[request_id]
        super().__delitem__(request_id)
        self._count(lease.scopes, self.held, -1)

    def pop(self, request_id: str, default: Any = _MISSING) -> Any:
        if request_id in self:
            lease = super().pop(request_id)
            self._count(lease.scopes, self.held, -1)
            return lease
        if default is _MISSING:
            raise KeyError(request_id)
        return default

    def clear(self) -> None:
        super().clear()
        self.held.clear()

    def update(self, *args: Any, **kwargs: Any) -> None:
        for request_id, lease in dict(*args, **kwargs).items():
            self[request_id] = lease

    def setdefault(self, request_id: str, lease: Lease) -> Lease:
        if request_id not in self:
            self[request_id] = lease
        return self[request_id]

    def in_use(self, scope: LimitScope) -> int:
        """The scope's requests on this replica: leases held and admissions under way."""
        return self.held[scope.key] + self.pending[scope.key]

    def start(self, scopes: list[LimitScope]) -> None:
        self._count(scopes, self.pending, 1)
        self.under_way += 1

    def end(self, scopes: list[LimitScope]) -> None:
        self._count(scopes, self.pending, -1)
        self.under_way -= 1


def concurrency_refusal(request_id: str, scope: LimitScope, used: int) -> Decision:
    """The limiter's own refusal for `scope`'s concurrency, decided on this replica."""
    now = time.time()
    return decide(request_id=request_id, scopes=(scope,), limited=[scope], tokens=0, now=now,
                  periods=Periods.at(now), headers=[],
                  refusals=[Refusal(0, CONC, CONCURRENCY_RETRY_HINT, used)])


def check(table: LocalAdmissions, scopes: list[LimitScope], request_id: str,
          max_under_way: int) -> Decision | None:
    """The refusal of a request before any limiter call (see the module docstring): a
    concurrency `Decision` (the caller's 429), or APIError 503 `server_busy`; None to go on."""
    for scope in scopes:
        limit = scope.quota.max_concurrent_requests
        if limit is not None and (used := table.in_use(scope)) >= limit:
            return concurrency_refusal(request_id, scope, used)
    if table.under_way >= max_under_way:
        raise APIError(503, f"This replica has {table.under_way} admissions under way, its bound; "
                       "retry shortly.", code="server_busy", headers={"retry-after": "1"})
    return None
