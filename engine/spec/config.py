"""`speculative_config`, as vLLM spells it: {"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}, or a draft model: {"model": DIR,
"num_speculative_tokens": k} (method "draft_model", implied by "model" as in vLLM). Checked on
construction, each error naming its field; the draft's vocabulary is checked against the
target's by `check_draft_model` (EngineConfig calls it)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32     # past this a row's draft is most of a step's budget
_DEFAULT_LOOKUP = 5             # vLLM's, when neither lookup bound is given


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """`method` "ngram" (prompt lookup) or "draft_model" (`model`: a smaller model's directory,
    the default method when `model` is given); `num_speculative_tokens` k, the most draft tokens a
    row gets per step; the suffix matched is `prompt_lookup_min`..`prompt_lookup_max` tokens
    (one given: both that; none: 5). `auto_disable` (Lockgate's own): per step and class,
    drafts are left out when the step-cost model says they cost more than the tokens they are
    expected to win (engine/spec/switch.py)."""

    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    auto_disable: bool = True
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method: {self.method!r} is not supported; "
                             f"one of {list(METHODS)}")
        self._check_model()
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

    def _check_model(self) -> None:
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model: the ngram method takes no model; "
                                 "leave method out (or 'draft_model') to draft with one")
            return
        if not isinstance(self.model, (str, Path)) or not str(self.model):
            raise ValueError("speculative_config.model: a draft model's directory is required "
                             f"with method 'draft_model'; got {self.model!r}")
        path = Path(self.model)
        if not path.is_dir():
            raise ValueError(f"speculative_config.model: {str(path)!r} is not a directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"speculative_config.model: {str(path)!r} has no config.json")
        object.__setattr__(self, "model", str(path))

    @property
    def draft_model(self) -> str | None:
        """The draft model's directory (None: the n-gram method)."""
        return self.model if self.method == "draft_model" else None

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


def check_draft_model(spec: SpeculativeConfig | None, target_dir: str) -> None:
    """A draft model must speak the target's vocabulary (the verifier compares token ids and
    distributions over the same vocabulary): the same `vocab_size` and, where both have one,
    the same tokenizer.json. Under tensor parallelism it runs whole on rank 0, beside that
    rank's shard of the target (a draft is small; splitting it would cost a collective per layer
    for each of its k forwards a step)."""
    draft = spec.draft_model if spec is not None else None
    if draft is None:
        return
    sizes = [json.loads((Path(d) / "config.json").read_text()).get("vocab_size") for d in (target_dir, draft)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"speculative_config.model: the draft's vocab_size {sizes[1]} differs from the "
                         f"target's {sizes[0]}; a draft must share the target's tokenizer")
    toks = [Path(d) / "tokenizer.json" for d in (target_dir, draft)]
    if all(t.is_file() for t in toks) and toks[0].read_bytes() != toks[1].read_bytes():
        raise ValueError(f"speculative_config.model: the draft's tokenizer.json differs from the target's "
                         f"(vocab_size {sizes[1]} both); a draft must share the target's tokenizer")
