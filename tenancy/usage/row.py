"""`UsageRow`: one finished request as written to `usage_records`, checked field by field
before it is queued (a row the database would refuse never reaches the writer's batch)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.models import SERVICE_TIERS, USAGE_STATUSES, utcnow
from lockgate.tenancy.validation import MODEL_NAME_MAX, as_utc, check_count, check_ms


@dataclass(slots=True)
class UsageRow:
    """One finished request, as written to `usage_records`."""

    request_id: str
    tenant_id: str
    api_key_id: str
    model: str
    service_tier: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    status: str
    queue_ms: float
    ttft_ms: float | None
    total_ms: float
    created_at: datetime | None = None    # None: when recorded
    client_request_id: str | None = None  # the client's x-request-id, for its reconciliation
    batch_id: str | None = None           # the batch whose line this was (the Batch API)
    budget_tokens: int | None = None      # what the budgets were charged (None: prompt + completion)

    def __post_init__(self) -> None:
        for f in ("request_id", "tenant_id", "api_key_id", "model", "service_tier"):
            v = getattr(self, f)
            if not isinstance(v, str) or not v:
                raise Invalid(f, f"must be a non-empty string, got {v!r}")
        if len(self.request_id) > 128:
            raise Invalid("request_id", "must be at most 128 characters")
        if self.client_request_id is not None and (
                not isinstance(self.client_request_id, str) or not 1 <= len(self.client_request_id) <= 128):
            raise Invalid("client_request_id", "must be null or a string of 1 to 128 characters")
        if self.batch_id is not None and (not isinstance(self.batch_id, str) or not 1 <= len(self.batch_id) <= 40):
            raise Invalid("batch_id", "must be null or a string of 1 to 40 characters")
        if len(self.model) > MODEL_NAME_MAX:
            raise Invalid("model", f"must be at most {MODEL_NAME_MAX} characters")
        if self.service_tier not in SERVICE_TIERS:
            raise Invalid("service_tier", f"must be one of {list(SERVICE_TIERS)}, "
                                          f"got {self.service_tier!r}")
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            check_count(getattr(self, f), f)
        if self.budget_tokens is not None:
            check_count(self.budget_tokens, "budget_tokens")
        if self.status not in USAGE_STATUSES:
            raise Invalid("status", f"must be one of {list(USAGE_STATUSES)}, got {self.status!r}")
        check_ms(self.queue_ms, "queue_ms")
        check_ms(self.ttft_ms, "ttft_ms", nullable=True)
        check_ms(self.total_ms, "total_ms")
        self.created_at = as_utc(self.created_at, "created_at")

    def values(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["created_at"] is None:
            out["created_at"] = utcnow()
        return out
