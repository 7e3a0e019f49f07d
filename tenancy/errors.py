"""Errors raised by the tenancy layer, the limiter's included; each names the field or resource
it is about."""

from __future__ import annotations

AUTH_REASONS = frozenset(
    {"missing", "invalid", "expired", "revoked", "tenant_suspended", "tenant_deleted"}
)


class TenancyError(Exception):
    """Base class of every error raised by `tenancy`."""

    field: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(TenancyError):
    """A resource (`what`, e.g. "tenant") with this id does not exist (or is deleted)."""

    def __init__(self, what: str, id: str | None) -> None:
        super().__init__(f"{what} {id!r} not found")
        self.what = what
        self.id = id


class Conflict(TenancyError):
    """The change clashes with existing data, e.g. a name already taken."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Invalid(TenancyError, ValueError):
    """Bad input; `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AuthError(TenancyError):
    """An API key was refused; `reason` is one of `AUTH_REASONS`."""

    def __init__(self, reason: str) -> None:
        if reason not in AUTH_REASONS:
            raise ValueError(f"reason: unknown auth failure reason {reason!r}")
        super().__init__(f"authentication failed: {reason}")
        self.reason = reason


class UnknownKeyPrefix(AuthError):
    """No stored key has the presented key's lookup prefix: every key with that prefix is
    invalid until one is created (so a refusal for this reason may be remembered)."""

    def __init__(self) -> None:
        super().__init__("invalid")


class LimiterUnavailable(TenancyError, RuntimeError):
    """The limiter's shared store cannot be reached or refused the call: nothing was decided
    (callers refuse the request rather than guess)."""
