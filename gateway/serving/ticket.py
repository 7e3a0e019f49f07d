"""Admission before expensive work, in two steps (`Ticket`).

1. Before the body is read: `admitted(state, principal)` counts the request against the
   tenant's and the key's request rate and takes its concurrency lease
   (`Limiter.acquire(..., tokens=0)`): a tenant past its rate or its concurrency is refused
   (429) before anything is parsed or tokenized, so it cannot buy other tenants' latency with
   large prompts.
2. Once the prompt is tokenized: `Ticket.reserve(tokens)` reserves prompt + max_tokens in the
   tokens-per-minute windows and the budgets (`Limiter.reserve`); a refusal there is a 429 too.

A request that ends between the two (a 400 or 413 from its body, a quota 429, a 404 model)
keeps its rate count and is charged nothing: the admission is settled to 0 tokens and its
lease freed (`release`), as OpenAI counts failed requests against the rate. Once a
`RequestRun` takes the ticket (`take`), the run settles or cancels it; a refusal for lack of
capacity (the engine's 503, flex's 429 `resource_unavailable`) cancels the admission, so it
never counts. A request refused by a limit writes no usage row.

Before either step, this replica's own bounds (`local_admissions`): a tenant's requests here
already at its concurrency (its plan's, else `default_max_concurrent_requests`) are refused
429 without asking the limiter, and past `max_admissions_in_flight` admissions under way the
replica answers 503 `server_busy`; so a burst meets its own limits, not a busy event loop.

A body declared no larger than `FAST_BODY_BYTES` is cheap to read, so its request takes one
round trip instead of two: it is admitted at once with its tokens once they are known, and
one that ends before (a 400, a token refusal) is counted then (`Ticket.count`), with the same
answers and counts as two steps would give.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import replace

from fastapi import Request

from lockgate.gateway.errors import APIError
from lockgate.gateway.serving.local_admissions import LocalAdmissions, check
from lockgate.gateway.state import AppState
from lockgate.gateway.tokenize_pool import current_tenant
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import Invalid, LimiterUnavailable
from lockgate.tenancy.limiter import Decision, Lease, LimitScope
from lockgate.tenancy.limiter.rebuild import key_scope_key, tenant_scope_key
from lockgate.tenancy.quota import Quota

logger = logging.getLogger(__name__)


def new_request_id() -> str:
    return secrets.token_hex(12)


def tenant_scope(tenant_id: str | None, quota: Quota) -> LimitScope:
    """A tenant's limits (the names `limiter.rebuild` finds its usage rows by)."""
    return LimitScope(tenant_scope_key(tenant_id), quota)


def key_scope(tenant_id: str | None, key_id: str, quota: Quota) -> LimitScope:
    """A key's limits, in its tenant's group (one Redis Cluster slot with the tenant's)."""
    return LimitScope(key_scope_key(key_id), quota, tag=tenant_scope_key(tenant_id))


def scopes_of(principal: Principal, default_concurrency: int | None = None) -> list[LimitScope]:
    """The limits a tenant's request is counted against: its tenant's and its key's; a tenant
    whose plan sets no `max_concurrent_requests` gets `default_concurrency`."""
    quota = principal.tenant_quota
    if quota.max_concurrent_requests is None and default_concurrency is not None:
        quota = replace(quota, max_concurrent_requests=default_concurrency)
    return [tenant_scope(principal.tenant_id, quota),
            key_scope(principal.tenant_id, principal.key_id, principal.key_quota)]


async def ask(step: Awaitable[Decision], request_id: str) -> Decision:
    """One limiter decision; an unreachable shared limiter is a 503, never a guess."""
    try:
        return await step
    except LimiterUnavailable as exc:
        logger.warning("rate limiter unavailable for %s: %s", request_id, exc)
        raise APIError(503, "The rate limiter is unavailable; retry shortly.",
                       code="limiter_unavailable", headers={"retry-after": "1"}) from None


def fmt_duration(seconds: float | None) -> str:
    """OpenAI's reset format: '20ms', '1s', '6m0s', '1h2m3s'."""
    if seconds is None:
        return "0s"
    if seconds < 1:
        return f"{max(1, round(seconds * 1000))}ms"
    s = int(-(-seconds // 1))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m}m{sec}s"
    if m:
        return f"{m}m{sec}s"
    return f"{sec}s"


def ratelimit_headers(d: Decision) -> dict[str, str]:
    h: dict[str, str] = {}
    if d.limit_requests is not None:
        h["x-ratelimit-limit-requests"] = str(d.limit_requests)
        h["x-ratelimit-remaining-requests"] = str(max(0, d.remaining_requests or 0))
        h["x-ratelimit-reset-requests"] = fmt_duration(d.reset_requests)
    if d.limit_tokens is not None:
        h["x-ratelimit-limit-tokens"] = str(d.limit_tokens)
        h["x-ratelimit-remaining-tokens"] = str(max(0, d.remaining_tokens or 0))
        h["x-ratelimit-reset-tokens"] = fmt_duration(d.reset_tokens)
    return h


def refusal(state: AppState, principal: Principal, d: Decision, *, counted: bool = True,
            tier: str | None = None) -> APIError:
    """The 429 of a limit that refused (OpenAI's codes and headers), counted in the metrics
    and, for the quota report and the console, by tenant, key, limit and service tier (in
    memory, flushed in batches); not counted when `counted` is False (a batch's line: the batch
    pauses, nobody got a 429). `tier`: the request's, once its body was read; before, the
    tenant's default tier is the one it would most likely have run in."""
    reason = d.limit or "unknown"
    if counted:
        state.metrics.rejections.labels(principal.tenant_name or "", reason).inc()
    if counted and principal.tenant_id is not None:
        scope = "key" if (d.scope or "").startswith("key:") else "tenant"
        state.refusals.record(principal.tenant_id, principal.key_id, scope, reason,
                              tier=tier or principal.default_tier)
    headers = ratelimit_headers(d)
    if d.retry_after is not None:
        headers["retry-after"] = str(max(1, int(-(-d.retry_after // 1))))
    if d.code == "insufficient_quota":
        headers["x-should-retry"] = "false"
    return APIError(429, d.message, code=d.code or "rate_limit_exceeded", headers=headers)


FAST_BODY_BYTES = 16 << 10
"""A body declared (Content-Length) this small is cheap to parse and tokenize: its request is
admitted in one limiter round trip once its tokens are known, and counted as step 1 would
have counted it if it ends before (`Ticket.count`). Larger or chunked bodies take two steps."""


class Ticket:
    """An admitted request before its run: its id, start time, lease and latest decision.
    A deferred ticket (`decision` None: a small body) is admitted at `reserve`."""

    def __init__(self, state: AppState, principal: Principal, request_id: str, t0: float,
                 decision: Decision | None, *, count_refusals: bool = True) -> None:
        self.state = state
        # False for a batch's line: a limit's refusal pauses the batch; the line is not a
        # request the tenant sent, so it is not counted against the request rate
        self.count_refusals = count_refusals
        self.principal = principal
        self.scopes = scopes_of(principal, state.settings.default_max_concurrent_requests)
        self.id = request_id
        self.t0 = t0
        self.decision = decision
        self.deferred = decision is None
        self.lease: Lease | None = decision.lease if decision is not None else None
        self.taken = False
        self.under_way = False      # counted among this replica's admissions under way
        self.tier: str | None = None    # the request's service tier, once its body was read
        if self.lease is not None:
            state.inflight[request_id] = self.lease     # heart-beaten from now on

    def start(self) -> None:
        """Count this admission as under way on the replica until it holds a lease or ends
        (`LocalAdmissions`); a replica's or a tenant's bound there refuses it first."""
        table = self.state.inflight
        if not isinstance(table, LocalAdmissions) or self.under_way:
            return
        d = check(table, self.scopes, self.id, self.state.settings.max_admissions_in_flight)
        if d is not None:
            raise refusal(self.state, self.principal, d)
        table.start(self.scopes)
        self.under_way = True

    def end(self) -> None:
        """No longer under way: it holds its lease now, or it ended. Idempotent."""
        table = self.state.inflight
        if self.under_way and isinstance(table, LocalAdmissions):
            table.end(self.scopes)
        self.under_way = False

    def _hold(self, d: Decision) -> Decision:
        """Keep an allowed decision and its lease (heart-beaten from now on)."""
        self.end()
        self.decision = d
        self.lease = d.lease
        if self.lease is not None:
            self.state.inflight[self.id] = self.lease
        return d

    def _refusal(self, d: Decision) -> APIError:
        return refusal(self.state, self.principal, d, counted=self.count_refusals, tier=self.tier)

    async def count(self) -> None:
        """A deferred request that ends before its tokens are reserved (a 400, a 404, a token
        refusal) counts as step 1 would have counted it: against the request rate, holding
        nothing. If the rate or the concurrency refuses it, that 429 is its answer, as it
        would have been before its body was read."""
        self.deferred = False
        d = await ask(self.state.limiter.acquire(self.id, self.scopes, 0), self.id)
        if not d.allowed:
            raise self._refusal(d)
        if d.lease is not None:
            try:
                await asyncio.shield(self.state.limiter.settle(d.lease, 0))
            except Exception:  # any failure: the lease expires by itself
                logger.warning("could not settle the count of %s", self.id, exc_info=True)

    async def _admit_at_once(self, tokens: int) -> Decision:
        d = await ask(self.state.limiter.acquire(self.id, self.scopes, tokens), self.id)
        self.deferred = False           # admitted or refused: counted either way from here
        if not d.allowed:
            if self.count_refusals and d.limit not in ("requests_per_minute", "max_concurrent_requests"):
                await self.count()      # the rate's or the concurrency's 429 comes first
            raise self._refusal(d)
        return self._hold(d)

    async def reserve(self, tokens: int) -> Decision:
        """Step 2: reserve `tokens`; a refusal (429) or an unreachable limiter (503) releases
        the admission first. A deferred ticket is admitted here, in one step."""
        if self.deferred:
            return await self._admit_at_once(tokens)
        if self.lease is None:
            raise RuntimeError(f"ticket {self.id} holds no lease")
        try:
            d = await ask(self.state.limiter.reserve(self.lease, tokens), self.id)
        except APIError:
            await self.release()
            raise
        except Invalid as exc:    # the admission is gone (abandoned while this replica lost Redis)
            await self.release()
            logger.warning("admission of %s lost before its tokens were reserved: %s", self.id, exc)
            raise APIError(503, "The request's admission expired; retry.", code="admission_expired",
                           headers={"retry-after": "1"}) from None
        if not d.allowed:
            await self.release()
            raise self._refusal(d)
        return self._hold(d)

    def take(self) -> Lease | None:
        """The run takes over the admission: from now on it settles or cancels it."""
        self.taken = True
        return self.lease

    async def release(self) -> None:
        """End an admission no run took: its rate count stays, no token is charged, its
        lease is freed. Idempotent."""
        if self.taken or self.lease is None:
            return
        lease, self.lease = self.lease, None
        self.state.inflight.pop(self.id, None)
        try:
            await asyncio.shield(self.state.limiter.settle(lease, 0))
        except Exception:  # any failure: the lease expires; the reconciler refunds the rest
            logger.warning("could not release the admission of %s", self.id, exc_info=True)


def small_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return length is not None and length.isdigit() and int(length) <= FAST_BODY_BYTES


@asynccontextmanager
async def admitted(state: AppState, principal: Principal, request: Request) -> AsyncIterator[Ticket]:
    """`_admitted`, with the tenant's large prompts queued as its own in the tokenizer pool."""
    token = current_tenant.set(principal.tenant_id)
    try:
        async with _admitted(state, principal, request) as ticket:
            yield ticket
    finally:
        current_tenant.reset(token)


@asynccontextmanager
async def _admitted(state: AppState, principal: Principal, request: Request) -> AsyncIterator[Ticket]:
    """Step 1, around everything a route does before its run takes the ticket: an exception,
    or a route that ends without a run, releases the admission. A small body's request is
    admitted at `reserve` instead (one round trip); if it fails before (4xx), it is counted."""
    ticket = Ticket(state, principal, new_request_id(), time.time(), None)
    ticket.start()          # this replica's own bounds, before any limiter call
    try:
        if small_body(request):
            try:
                yield ticket
            except APIError as exc:
                if ticket.deferred and 400 <= exc.status < 500:
                    await ticket.count()        # may answer the rate's 429 instead
                raise
            finally:
                await ticket.release()
            return
        d = await ask(state.limiter.acquire(ticket.id, ticket.scopes, 0), ticket.id)
        if not d.allowed:
            raise refusal(state, principal, d)
        ticket.deferred = False
        ticket._hold(d)
        try:
            yield ticket
        finally:
            await ticket.release()
    finally:
        ticket.end()
