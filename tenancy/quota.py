"""A quota: the limits of one tenant or one API key (`None` means unlimited), and its five
columns on a tenant's or a key's row."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from typing import Any

# PostgreSQL's bigint, the quota columns' type: a larger limit fails mid-statement there
BIGINT_MAX = 2**63 - 1

QUOTA_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "daily_token_budget",
    "monthly_token_budget",
)


@dataclass(frozen=True, slots=True)
class Quota:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    daily_token_budget: int | None = None      # UTC day
    monthly_token_budget: int | None = None    # UTC calendar month

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"{f.name}: must be an integer or null, got {v!r}")
            if not 0 <= v <= BIGINT_MAX:
                raise ValueError(f"{f.name}: must be from 0 to {BIGINT_MAX}, got {v}")

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, name) is None for name in QUOTA_FIELDS)

    def to_dict(self) -> dict[str, int | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Quota:
        data = data or {}
        unknown = set(data) - set(QUOTA_FIELDS)
        if unknown:
            raise ValueError(f"quota: unknown field(s) {sorted(unknown)}; known: {list(QUOTA_FIELDS)}")
        return cls(**data)


def quota_of(row: Any) -> Quota:
    """The quota stored in a row's quota columns (a tenant or an API key)."""
    return Quota(**{name: getattr(row, name) for name in QUOTA_FIELDS})


def store_quota(row: Any, quota: Quota) -> None:
    """Write `quota` into a row's quota columns."""
    for name in QUOTA_FIELDS:
        setattr(row, name, getattr(quota, name))


def check_price(value: Any, field: str = "cached_input_price") -> float:
    """A price as a fraction of a prompt token: a number from 0 to 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= 1:
        raise ValueError(f"{field}: must be a number from 0 to 1, got {value!r}")
    return float(value)


def budget_tokens(prompt: int, cached: int, completion: int, cached_input_price: float) -> int:
    """What a request's tokens count against the day and month budgets: every completion
    token and uncached prompt token, and the `cached` prompt tokens (those the engine read
    from its prefix cache) at `cached_input_price` of a token each, rounded up once for the
    request. The price is read as the decimal it was written as (0.1 is a tenth), so 30
    cached tokens at 0.1 count 3, not 4."""
    cached = min(max(cached, 0), prompt)
    if cached_input_price >= 1:
        return prompt + completion
    priced = math.ceil(cached * Fraction(repr(float(cached_input_price))))
    return prompt - cached + priced + completion
