"""`speculative_config`, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}. Checked on construction, each error naming
its field. Draft models are not served (yet): only the n-gram method."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32     # past this a row's draft is most of a step's budget
_DEFAULT_LOOKUP = 5             # vLLM's, when neither lookup bound is given


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """`method` "ngram" (prompt lookup); `num_speculative_tokens` k, the most draft tokens a
    row gets per step; the suffix matched is `prompt_lookup_min`..`prompt_lookup_max` tokens
    (one given: both that; none: 5). `auto_disable` (Lockgate's own): per step and class,
    drafts are left out when the step-cost model says they cost more than the tokens they are
    expected to win (engine/spec/switch.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    auto_disable: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not supported; "
                             f"one of {list(METHODS)} (draft models are not served)")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError("speculative_config.num_speculative_tokens: an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}] is required; got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"speculative_config.{name}: must be an integer >= 1; got {value!r}")
        lo = lo if lo is not None else (hi if hi is not None else _DEFAULT_LOOKUP)
        hi = hi if hi is not None else lo
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed "
                             f"prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if not isinstance(self.auto_disable, bool):
            raise ValueError(f"speculative_config.auto_disable: must be a boolean; got {self.auto_disable!r}")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """`EngineConfig.speculative_config` as given (a mapping, as vLLM takes it, or this
        class, or None: no speculation) -> the checked config or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config: must be a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens: required")
        return cls(**value)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
