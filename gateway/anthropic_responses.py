"""The Messages API's answers: a message (`message_body`) and its stream's events
(`MessageEvents`: `message_start`, `ping`, `content_block_start` / `_delta` / `_stop` with
`text_delta` and `input_json_delta`, `message_delta` with the stop reason and the usage,
`message_stop`), built from the engine's outputs as chat builds its choices.

Usage as Anthropic counts it: `input_tokens` are the prompt tokens the engine computed,
`cache_read_input_tokens` those it read from its prefix cache (chat's
`prompt_tokens_details.cached_tokens`; the two add up to chat's `prompt_tokens`), and
`cache_creation_input_tokens` is 0 (the cache fills itself; nothing is billed for writing it).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pydantic_core import from_json

from lockgate.engine import CompletionOutput
from lockgate.gateway.auto_calls import AutoCallReader
from lockgate.gateway.responses import Usage
from lockgate.gateway.tool_calls import ToolCallReader, ToolPlan, read_tool_calls

# the API's tiers as Anthropic names what a message was served on
_TIERS = {"default": "standard", "priority": "priority", "flex": "batch"}


def new_message_id(request_id: str) -> str:
    return f"msg_{request_id}"


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def usage(prompt: int, cached: int, completion: int, tier: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"input_tokens": prompt - cached, "output_tokens": completion,
                           "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}
    if tier is not None:
        out["service_tier"] = _TIERS.get(tier, "standard")
    return out


def of_usage(u: Usage, tier: str | None = None) -> dict[str, Any]:
    """Chat's usage (a run's) in Anthropic's shape."""
    return usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"], tier)


def stop_reason(c: CompletionOutput, stop_sequences: list[str], called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): `tool_use` for a forced answer that completed its calls,
    `stop_sequence` (and which) for a stop string, `max_tokens` for the budget, else `end_turn`."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.stop_reason in stop_sequences:
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def message_body(request_id: str, model: str, c: CompletionOutput, u: Usage, tier: str,
                 plan: ToolPlan | None, stop_sequences: list[str]) -> dict[str, Any]:
    """A finished message, as its stream builds it (`MessageEvents`): a forced answer is its
    `tool_use` blocks (one cut by `max_tokens` with the input read so far, as the `anthropic`
    client reads the stream's partial JSON); under `auto`, the calls read out of the text are
    `tool_use` blocks between its text blocks; any other answer one text block (none when it
    is empty)."""
    calls: list[dict[str, Any]] | None = None
    if plan is not None and plan.forced:
        reader = ToolCallReader()
        reader.feed(c.text)
        content = [partial_tool_use(name, arguments) for name, arguments in reader.calls]
        calls = content if c.finish_reason == "stop" and read_tool_calls(c.text) else None
    elif plan is not None and plan.auto:
        content = auto_blocks(c.text, plan.names, plan.auto_max_calls)
        calls = [b for b in content if b["type"] == "tool_use"] if c.finish_reason == "stop" else None
    else:
        content = [{"type": "text", "text": c.text}] if c.text else []
    reason, sequence = stop_reason(c, stop_sequences, bool(calls))
    return {"id": new_message_id(request_id), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence, "usage": of_usage(u, tier)}


def auto_blocks(text: str, names: frozenset[str], max_calls: int) -> list[dict[str, Any]]:
    """Under `auto`: the text's blocks, the calls read out of it `tool_use` blocks between
    the text blocks of what is around them."""
    reader = AutoCallReader(names, max_calls)
    blocks: list[dict[str, Any]] = []
    for kind, value in reader.feed(text) + reader.finish():
        if kind == "call":
            blocks.append(tool_use(value))
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += value
        else:
            blocks.append({"type": "text", "text": value})
    return blocks


def partial_tool_use(name: str, arguments: str) -> dict[str, Any]:
    """A `tool_use` block of a call whose arguments may be cut short: what they hold so far,
    an unfinished string left out (the `anthropic` client's reading of a stream's partial JSON)."""
    try:
        value = from_json(arguments or "{}", allow_partial=True)
    except ValueError:
        value = {}
    return {"type": "tool_use", "id": new_tool_use_id(), "name": name,
            "input": value if isinstance(value, dict) else {}}


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": new_tool_use_id(), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def event(data: dict[str, Any]) -> bytes:
    return (f"event: {data['type']}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode()
            + b"\n\n")


class MessageEvents:
    """One message's stream, fed the engine's outputs in order: the events each adds.
    A forced answer's text is read as tool calls (`ToolCallReader`): each call a `tool_use`
    block whose arguments arrive as `input_json_delta`s; under `auto`, the calls read out of
    the text (`AutoCallReader`) are `tool_use` blocks, each whole once recognized, between
    the text blocks around them; any other answer is one text block."""

    def __init__(self, request_id: str, model: str, prompt_len: int, plan: ToolPlan | None,
                 stop_sequences: list[str]) -> None:
        self.request_id = request_id
        self.model = model
        self.prompt_len = prompt_len
        self.reader = ToolCallReader() if plan is not None and plan.forced else None
        self.auto = AutoCallReader(plan.names, plan.auto_max_calls) if plan is not None and plan.auto else None
        self.stop_sequences = stop_sequences
        self.started = False
        self.blocks = 0                  # blocks opened so far
        self.open = False                # the last one is still open
        self.text_open = False           # ... and it is a text block

    def start(self, cached: int) -> list[bytes]:
        self.started = True
        message: dict[str, Any] = {
            "id": new_message_id(self.request_id), "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(self.prompt_len, cached, 0)}
        return [event({"type": "message_start", "message": message}), event({"type": "ping"})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        out.append(event({"type": "content_block_start", "index": self.blocks, "content_block": block}))
        self.blocks += 1
        self.open = True
        return out

    def _close(self) -> list[bytes]:
        if not self.open:
            return []
        self.open = False
        return [event({"type": "content_block_stop", "index": self.blocks - 1})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def feed(self, c: CompletionOutput, cached: int) -> list[bytes]:
        out = [] if self.started else self.start(cached)
        if self.auto is not None:
            return out + self._auto(self.auto.feed(c.delta_text))
        if self.reader is None:
            return out + self._text(c.delta_text)
        for d in self.reader.feed(c.delta_text):
            if "id" in d:
                out += self._open({"type": "tool_use", "id": new_tool_use_id(),
                                   "name": d["function"]["name"], "input": {}})
            if d["function"]["arguments"]:
                out.append(self._delta({"type": "input_json_delta", "partial_json": d["function"]["arguments"]}))
        return out

    def _text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if text:
            if not (self.open and self.text_open):
                out += self._open({"type": "text", "text": ""})
                self.text_open = True
            out.append(self._delta({"type": "text_delta", "text": text}))
        return out

    def _auto(self, events: list[tuple[str, Any]]) -> list[bytes]:
        out: list[bytes] = []
        for kind, value in events:
            if kind == "content":
                out += self._text(value)
                continue
            block = tool_use(value)
            out += self._open({**block, "input": {}})
            self.text_open = False
            out.append(self._delta({"type": "input_json_delta", "partial_json": value["function"]["arguments"]}))
        return out

    def end(self, c: CompletionOutput | None, u: Usage) -> list[bytes]:
        """The closing events, once the usage row is committed."""
        cached = u["prompt_tokens_details"]["cached_tokens"]
        out = [] if self.started else self.start(cached)
        if self.auto is not None:
            out += self._auto(self.auto.finish())
        out += self._close()
        reader = self.reader or self.auto
        called = reader is not None and bool(reader.calls) and c is not None and c.finish_reason == "stop"
        reason, sequence = stop_reason(c, self.stop_sequences, called) if c is not None else ("end_turn", None)
        out.append(event({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": of_usage(u)}))
        out.append(event({"type": "message_stop"}))
        return out
