"""The engine's errors. The gateway maps each to an HTTP status; none of them is HTTP-aware."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class PromptTooLong(EngineError, ValueError):
    """The prompt cannot fit the model's context or the whole KV cache."""

    def __init__(self, message: str, *, field: str = "prompt") -> None:
        super().__init__(message)
        self.field = field


class EngineOverloaded(EngineError):
    """The queue is full (engine/admission.py); retry after `retry_after` seconds. `shed`:
    the request had been queued and was shed, before it sent anything, to make room for
    more urgent work; otherwise it was refused on arrival."""

    def __init__(self, message: str, *, service_class: str | None = None,
                 retry_after: float = 1.0, shed: bool = False) -> None:
        super().__init__(message)
        self.service_class = service_class
        self.retry_after = retry_after
        self.shed = shed


class UnknownModel(EngineError, ValueError):
    """The request names a model variant this engine does not serve."""


class EngineDead(EngineError):
    """The step loop stopped on an error; no further requests are served."""
