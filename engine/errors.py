"""The engine's errors. The gateway maps each to an HTTP status; none of them is HTTP-aware.

A request the engine refuses as invalid raises `InvalidRequest` (a `ValueError`) whose
`field` names what was wrong: the gateway answers 400 with that `param` and never reads
the message to find it.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequest(EngineError, ValueError):
    """A request, its sampling parameters or an adapter that can never run; `field` names
    the argument at fault (`prompt`, `max_tokens`, `lora_name`...)."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLong(InvalidRequest):
    """The prompt cannot fit the model's context or the whole KV cache."""

    def __init__(self, message: str, *, field: str = "prompt") -> None:
        super().__init__(message, field=field)


class UnknownModel(InvalidRequest):
    """The request names a model variant this engine does not serve."""

    def __init__(self, message: str, *, field: str = "model") -> None:
        super().__init__(message, field=field)


class LoRAError(InvalidRequest):
    """An adapter that cannot be served. `field`: `lora_name` (its name clashes),
    `base_model_name` (its tensors fit another base model), `lora_request`, `lora_int_id`,
    or `lora_path` (anything wrong with what the adapter's directory holds)."""

    def __init__(self, message: str, *, field: str = "lora_path") -> None:
        super().__init__(message, field=field)


class AdapterInUse(LoRAError):
    """An adapter cannot be removed or unloaded while requests use it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, field="lora_name")


class GrammarError(InvalidRequest):
    """A structured-output spec (JSON schema, regex, choice) that does not compile to a
    grammar, is too large, or took too long to compile; `field` names the spec."""

    def __init__(self, message: str, *, field: str = "structured_outputs") -> None:
        super().__init__(message, field=field)


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


class EngineDead(EngineError):
    """The step loop stopped on an error; no further requests are served."""


class RankFailure(EngineError):
    """A tensor-parallel rank failed: it could not start (`RankStartupError`), died, or a
    collective or a hand-off to it failed or timed out. `rank` names it where known."""

    def __init__(self, message: str, *, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


class RankStartupError(RankFailure):
    """A rank failed while starting (spawning, loading its shard, joining the group)."""
