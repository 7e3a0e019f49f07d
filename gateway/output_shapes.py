"""The OpenAI response shapes the routes share: logprobs of chat and completions, SSE events."""

from __future__ import annotations

import json

from lockgate.engine import CompletionOutput, Logprob


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


