"""Sampling parameters, as vLLM's: what a caller asks of one request's completions."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from lockgate.engine.errors import InvalidRequest

GrammarKind = Literal["json", "json_object", "regex", "choice"]


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's `StructuredOutputsParams`): exactly one of a
    JSON schema (`json`, a dict or its text), any JSON object (`json_object`), a regular
    expression (`regex`, Rust regex syntax) or one of a list of strings (`choice`). JSON is
    compact (no whitespace between tokens) and keeps the schema's property order."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object is True else []
        if len(kinds) != 1:
            raise InvalidRequest("structured_outputs: set exactly one of json, regex, choice, json_object "
                                 f"(got {kinds or 'none'})", field="structured_outputs")
        if not isinstance(self.json_object, bool):
            raise InvalidRequest("structured_outputs.json_object: must be a boolean",
                                 field="structured_outputs.json_object")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequest("structured_outputs.json: must be a JSON schema (an object or its text)",
                                 field="structured_outputs.json")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise InvalidRequest("structured_outputs.regex: must be a non-empty string",
                                 field="structured_outputs.regex")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequest("structured_outputs.choice: must be a non-empty list of non-empty strings",
                                 field="structured_outputs.choice")

    @property
    def kind(self) -> GrammarKind:
        if self.json is not None:
            return "json"
        if self.regex is not None:
            return "regex"
        return "choice" if self.choice is not None else "json_object"

    def key(self) -> tuple[GrammarKind, str]:
        """The compile cache's key: the kind and the spec's text (a schema's property order
        kept: it is the order the output follows)."""
        kind = self.kind
        if kind == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json, separators=(",", ":"))
            return kind, text
        if kind == "choice":
            return kind, json.dumps(self.choice)
        return kind, self.regex or ""


@dataclass(slots=True)
class SamplingParams:
    """How to sample a request's completions; checked on construction.

    Greedy decoding is ``temperature=0``. A ``seed`` makes a request's samples the same
    whatever else shares its batch (the draw for each token depends only on the seed, the
    sample's index and the token's position).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # the output is constrained to a grammar: it ends ("stop") once the grammar is complete,
    # whatever min_tokens or ignore_eos say (engine/grammar.py)
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a number added to its logit before sampling (OpenAI's and vLLM's; -100..100):
    # -100 all but bans a token, +100 all but forces it
    logit_bias: dict[int, float] | None = None
    # speculative decoding (where the engine has a `speculative_config`): False keeps this
    # request's decodes to one token a step (its output is the same either way)
    speculative: bool = True
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequest(f"n must be an integer >= 1, got {self.n!r}", field="n")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}",
                                 field="max_tokens")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number, got {value!r}", field=name)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
                                 field="min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                                 field="min_tokens")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature!r}", field="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", field="top_p")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise InvalidRequest(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}",
                                 field="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}", field="min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequest(f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}",
                                 field="presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequest(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}",
                                 field="frequency_penalty")
        if self.repetition_penalty <= 0:
            raise InvalidRequest(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}",
                                 field="repetition_penalty")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise InvalidRequest(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}",
                                 field="logprobs")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}", field="seed")
        if self.top_k == 0:
            self.top_k = -1
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise InvalidRequest("stop must be a non-empty string or a list of non-empty strings",
                                 field="stop")
        self.stop_strings = stops
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise InvalidRequest("stop_token_ids must be non-negative integers", field="stop_token_ids")
        self.stop_token_ids = ids
        if self.logit_bias is not None:
            self.logit_bias = _checked_bias(self.logit_bias)
        if not isinstance(self.speculative, bool):
            raise InvalidRequest(f"speculative must be a boolean, got {self.speculative!r}", field="speculative")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequest("structured_outputs: expected StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}", field="structured_outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _checked_bias(bias: Any) -> dict[int, float] | None:
    """`logit_bias` as {token id: bias}, each id an integer >= 0 and each bias a finite number
    in [-100, 100] (the vocabulary's bound is checked with the request: check_request)."""
    if not isinstance(bias, dict):
        raise InvalidRequest(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}",
                             field="logit_bias")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest(f"logit_bias: token id {token!r} is not an integer >= 0", field="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise InvalidRequest(f"logit_bias: the bias of token {token} must be a number in [-100, 100], "
                                 f"got {value!r}", field="logit_bias")
    return dict(bias) or None
