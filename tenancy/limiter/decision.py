"""The `Decision` of an admission, built the same way from either backend's raw findings:
the limits that refused (`Refusal`), the rate-limit header values (`Header`), the message."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from lockgate.tenancy.limiter.base import (
    CONC,
    CONCURRENCY_RETRY_HINT,
    DAY,
    INSUFFICIENT_QUOTA,
    MONTH,
    RATE_LIMIT,
    RPM,
    TPM,
    WINDOW,
    Decision,
    Lease,
    LimitScope,
)
from lockgate.tenancy.limiter.periods import Periods
from lockgate.tenancy.quota import QUOTA_FIELDS


@dataclass(frozen=True)
class Refusal:
    """One limit that refused: scope index (into the limited scopes), field index, seconds until
    it would admit this request (None: never), and its current use."""

    scope: int
    field: int
    retry: float | None
    used: int


@dataclass(frozen=True)
class Header:
    """Rate-limit header values of one scope: kind 0 requests, 1 tokens."""

    scope: int
    kind: int
    limit: int
    remaining: int
    reset: float | None


def _message(r: Refusal, scope: LimitScope, tokens: int, retry: float | None) -> str:
    """Human text naming the limit, its value, the scope and when to retry."""
    name = QUOTA_FIELDS[r.field]
    limit = getattr(scope.quota, name)
    key = scope.key
    wait = "" if retry is None else f" Retry in {retry:.2f} s."
    if r.field == RPM:
        if r.retry is None:
            return f"requests_per_minute of {key} is {limit}: no request can pass."
        return (f"Rate limit reached for requests_per_minute of {key}: limit {limit} requests "
                f"per {WINDOW:g} s, {r.used} admitted in the current window.{wait}")
    if r.field == TPM:
        if r.retry is None:
            return (f"This request reserves {tokens} tokens (prompt + max_tokens), more than the "
                    f"tokens_per_minute limit of {limit} of {key}: it can never pass. Lower "
                    f"max_tokens or shorten the prompt.")
        return (f"Rate limit reached for tokens_per_minute of {key}: limit {limit} tokens per "
                f"{WINDOW:g} s, {r.used} in the current window, this request reserves {tokens} "
                f"(prompt + max_tokens).{wait}")
    if r.field == CONC:
        if r.retry is None:
            return f"max_concurrent_requests of {key} is {limit}: no request can pass."
        return (f"Too many concurrent requests for {key}: max_concurrent_requests is {limit} "
                f"and {r.used} are in flight.{wait}")
    period = "day" if r.field == DAY else "month"
    if r.retry is None:
        return (f"This request reserves {tokens} tokens (prompt + max_tokens), more than the "
                f"{name} of {limit} of {key}: it can never pass. Lower max_tokens or shorten "
                f"the prompt.")
    return (f"Token budget exhausted: {name} of {key} is {limit}, {r.used} tokens used this UTC "
            f"{period}, this request reserves {tokens}. It resets at the start of the next UTC "
            f"{period}, in {retry:.0f} s.")


def _tightest(headers: list[Header], kind: int) -> Header | None:
    """The header of the scope with the least remaining (ties: the longest reset)."""
    hs = [h for h in headers if h.kind == kind]
    if not hs:
        return None
    return min(hs, key=lambda h: (h.remaining, -(math.inf if h.reset is None else h.reset)))


def decide(
    *,
    request_id: str,
    scopes: tuple[LimitScope, ...],
    limited: list[LimitScope],
    tokens: int,
    now: float,
    periods: Periods,
    refusals: list[Refusal],
    headers: list[Header],
    epoch: str = "",
) -> Decision:
    """Build the Decision from the raw findings of a backend (same for both backends)."""
    req = _tightest(headers, 0)
    tok = _tightest(headers, 1)
    hdr: dict[str, Any] = {
        "limit_requests": req.limit if req else None,
        "remaining_requests": req.remaining if req else None,
        "reset_requests": req.reset if req else None,
        "limit_tokens": tok.limit if tok else None,
        "remaining_tokens": tok.remaining if tok else None,
        "reset_tokens": tok.reset if tok else None,
    }
    if not refusals:
        lease = Lease(request_id=request_id, scopes=scopes, reserved_tokens=tokens,
                      day=periods.day, month=periods.month, acquired_at=now, epoch=epoch)
        return Decision(allowed=True, lease=lease, code=None, limit=None, scope=None,
                        message="ok", retry_after=None, **hdr)

    def retry_of(r: Refusal) -> float | None:
        if r.retry is None:
            return None
        if r.field == CONC:
            return min(r.retry, CONCURRENCY_RETRY_HINT)
        return r.retry

    # A limit that can never pass wins; otherwise the one that makes the request wait longest.
    never = [r for r in refusals if r.retry is None]
    worst = never[0] if never else max(refusals, key=lambda r: retry_of(r) or 0.0)
    scope = limited[worst.scope]
    retry = retry_of(worst)
    return Decision(
        allowed=False,
        lease=None,
        code=INSUFFICIENT_QUOTA if worst.field in (DAY, MONTH) else RATE_LIMIT,
        limit=QUOTA_FIELDS[worst.field],
        scope=scope.key,
        message=_message(worst, scope, tokens, retry),
        retry_after=retry,
        **hdr,
    )



def grown(d: Decision, lease: Lease, tokens: int) -> Decision:
    """The decision of `Limiter.reserve`: when allowed, its lease is ``lease`` with ``tokens``
    more reserved (``decide`` built a fresh one); a refusal as it is."""
    if not d.allowed:
        return d
    return replace(d, lease=replace(lease, reserved_tokens=lease.reserved_tokens + tokens))
