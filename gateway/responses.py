"""The bodies the OpenAI routes answer with, typed: one builder a shape. A chat completion
and a text completion share their head (`id`, `created`, `model`, `service_tier`) and their
usage; their choices, chunks and logprobs differ. Typed dicts, not validated models: a body
is built once per answer and once per streamed chunk, on the hot path, and its types are
checked statically (mypy) instead. SSE events (`sse`) carry the same shapes."""

from __future__ import annotations

import json
from typing import Any, Literal, TypedDict

from lockgate.engine import CompletionOutput, Logprob


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Head(TypedDict):
    """What every answer and chunk of one request starts with."""

    id: str
    created: int
    model: str
    service_tier: str
    system_fingerprint: None


class ChatChoice(TypedDict):
    index: int
    message: dict[str, Any]
    logprobs: dict | None
    finish_reason: str | None


class CompletionChoice(TypedDict):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None


class ChatChunkChoice(TypedDict):
    index: int
    delta: dict[str, Any]
    logprobs: dict | None
    finish_reason: str | None


Kind = Literal["chat", "completion"]
# (prefix of the id, object of the answer, object of a chunk) by kind
_OBJECTS: dict[str, tuple[str, str, str]] = {
    "chat": ("chatcmpl", "chat.completion", "chat.completion.chunk"),
    "completion": ("cmpl", "text_completion", "text_completion"),
}


def head(kind: Kind, request_id: str, created: float, model: str, tier: str) -> Head:
    return {"id": f"{_OBJECTS[kind][0]}-{request_id}", "created": int(created), "model": model,
            "service_tier": tier, "system_fingerprint": None}


def answer(kind: Kind, h: Head, choices: list[ChatChoice] | list[CompletionChoice], usage: Usage | None) -> dict:
    """The JSON body of a finished request."""
    return {**h, "object": _OBJECTS[kind][1], "choices": choices, "usage": usage}


def chunk(kind: Kind, h: Head, choices: list[ChatChunkChoice] | list[CompletionChoice],
          usage: dict | None = None) -> dict:
    """One streamed chunk; `usage` ({} for none, {"usage": ...} otherwise) as `chunk_usage` gives."""
    return {**h, "object": _OBJECTS[kind][2], "choices": choices, **(usage or {})}


def usage_chunk(kind: Kind, h: Head, usage: Usage) -> dict:
    """The stream's closing chunk with the usage (`stream_options.include_usage`)."""
    return {**h, "object": _OBJECTS[kind][2], "choices": [], "usage": usage}


def _bytes(s: str | None) -> list[int]:
    return list((s or "").encode("utf-8"))


def _ranked(entry: dict[int, Logprob], top: int) -> list[Logprob]:
    """The entries ranked 1..`top`, best first."""
    ranked = [(v.rank, v) for v in entry.values() if v.rank is not None and v.rank <= top]
    return [v for _, v in sorted(ranked, key=lambda rv: rv[0])][:top]


def chat_logprobs(c: CompletionOutput, start: int, top: int) -> dict | None:
    if c.logprobs is None:
        return None
    content = []
    for pos in range(start, len(c.logprobs)):
        entry = c.logprobs[pos]
        tok = c.token_ids[pos]
        chosen = entry[tok]
        tops = _ranked(entry, top)
        content.append({
            "token": chosen.decoded_token, "logprob": chosen.logprob, "bytes": _bytes(chosen.decoded_token),
            "top_logprobs": [{"token": v.decoded_token, "logprob": v.logprob,
                              "bytes": _bytes(v.decoded_token)} for v in tops],
        })
    return {"content": content, "refusal": None}


def completion_logprobs(c: CompletionOutput, start: int, top: int, text_offset: int) -> dict | None:
    if c.logprobs is None:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    off = text_offset
    for pos in range(start, len(c.logprobs)):
        entry = c.logprobs[pos]
        chosen = entry[c.token_ids[pos]]
        tokens.append(chosen.decoded_token)
        lps.append(chosen.logprob)
        best = _ranked(entry, top)
        tops.append({v.decoded_token: v.logprob for v in best} if top else None)
        offsets.append(off)
        off += len(chosen.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


