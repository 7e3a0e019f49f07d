"""OpenAI request bodies, checked field by field.

Unknown fields are refused (as OpenAI does: "Unrecognized request argument supplied"), and
OpenAI fields that Lockgate does not implement are refused by name, never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.errors import APIError

# OpenAI fields Lockgate does not implement: refused when set to anything but null.
UNSUPPORTED_CHAT = (
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call",
    "response_format", "logit_bias", "audio", "modalities", "prediction", "store",
    "metadata", "reasoning_effort", "web_search_options", "verbosity", "prompt_cache_key",
    "safety_identifier",
)
UNSUPPORTED_COMPLETION = ("logit_bias", "suffix", "best_of", "echo")

# neutral values of unsupported completion fields that clients send by default
_NEUTRAL = {"best_of": (1,), "echo": (False,)}


def refuse_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name in body and body[name] is not None and body[name] not in _NEUTRAL.get(name, ()):
            raise APIError(400, f"{name} is not supported by Lockgate", param=name,
                           code="unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=64)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(_Strict):
    model: str = Field(min_length=1, max_length=256)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, for its users
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    cache_salt: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop: stop sequences must be non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        ids = [x for x in p if isinstance(x, int)]    # the list is of one kind (validated)
        if ids and len(ids) == len(p):
            return [ids]              # one prompt of token ids
        return [x for x in p if not isinstance(x, int)]   # several prompts: strings or id lists
