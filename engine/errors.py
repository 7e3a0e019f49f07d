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
    """A service class's waiting queue is full; retry later."""


class UnknownModel(EngineError, ValueError):
    """The request names a model variant this engine does not serve."""


class EngineDead(EngineError):
    """The step loop stopped on an error; no further requests are served."""
