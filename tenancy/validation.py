"""Argument checks shared by the tenancy modules: each returns the checked value (normalised
where that is defined) or raises `Invalid` naming the field. Arguments: the value, then its field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.quota import BIGINT_MAX, Quota

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
NAME_MAX = 64
MODEL_NAME_MAX = 128
MAX_LIST_LIMIT = 1000


def check_actor(actor: Any) -> str:
    """Who makes a change, as written to the audit log."""
    if not isinstance(actor, str) or not actor.strip() or len(actor) > 64:
        raise Invalid("actor", "must be a non-empty string of at most 64 characters")
    return actor


def as_utc(value: Any, field: str) -> datetime | None:
    """An aware UTC datetime (naive input is taken to be UTC), or None."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise Invalid(field, f"must be a datetime, got {type(value).__name__}")
    try:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except OverflowError:       # year 9999 behind UTC, or year 1 ahead of it
        raise Invalid(field, f"{value.isoformat()} is out of range in UTC") from None


def check_name(name: Any) -> str:
    """A tenant's or an adapter's name: 1 to `NAME_MAX` characters of `NAME_RE`."""
    if not isinstance(name, str):
        raise Invalid("name", f"must be a string, got {type(name).__name__}")
    if not 1 <= len(name) <= NAME_MAX:
        raise Invalid("name", f"must be 1 to {NAME_MAX} characters, got {len(name)}")
    if not NAME_RE.match(name):
        raise Invalid("name", f"{name!r} must match {NAME_RE.pattern} "
                              "(letters, digits, '.', '_', '-'; starting with a letter or digit)")
    return name


def check_text(value: Any, field: str) -> str:
    """A string the database looks up or stores (an id, a name): PostgreSQL refuses a NUL in
    text mid-statement, so it is refused here first, whatever the backend."""
    if not isinstance(value, str):
        raise Invalid(field, f"must be a string, got {type(value).__name__}")
    if "\x00" in value:
        raise Invalid(field, "must not contain a NUL character (\\u0000)")
    return value


def check_str_list(value: Any, field: str) -> list[str]:
    """Any iterable of strings (not a string itself, none holding a NUL), as a list."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise Invalid(field, f"must be a list of strings, got {type(value).__name__}")
    items = list(value)
    for item in items:
        if not isinstance(item, str):
            raise Invalid(field, f"must be a list of strings; found {item!r}")
        check_text(item, field)
    return items


def check_count(value: Any, field: str) -> int:
    """An integer from 0 to `BIGINT_MAX` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= BIGINT_MAX:
        raise Invalid(field, f"must be an integer from 0 to {BIGINT_MAX}, got {value!r}")
    return value


def check_ms(value: Any, field: str, nullable: bool = False) -> None:
    """A finite duration >= 0 in milliseconds (None too when `nullable`)."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise Invalid(field, f"must be a finite number >= 0, got {value!r}")


def check_list_limit(limit: Any) -> int:
    """The page size of a listing: 1 to `MAX_LIST_LIMIT`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise Invalid("limit", f"must be an integer from 1 to {MAX_LIST_LIMIT}, got {limit!r}")
    return limit


def check_quota(quota: Any) -> Quota:
    """A `Quota`, from a Quota, a dict of its fields, or None (unlimited)."""
    if quota is None:
        return Quota()
    if isinstance(quota, Quota):
        return quota
    if isinstance(quota, dict):
        try:
            return Quota.from_dict(quota)
        except (TypeError, ValueError) as exc:
            raise Invalid("quota", str(exc)) from None
    raise Invalid("quota", f"must be a Quota, a dict or null, got {type(quota).__name__}")


def check_pepper(pepper: Any) -> bytes:
    """The key-hashing pepper: non-empty bytes."""
    if not isinstance(pepper, (bytes, bytearray)) or not pepper:
        raise Invalid("pepper", "must be non-empty bytes")
    return bytes(pepper)
