"""The Responses API's answer bodies: the Response object, its output items, its usage in
OpenAI's shape, the input items as stored and listed, and the stream's events.

`OutputWriter` reads the model's text as it grows and writes both the output items and the
events that stream them, so a streamed answer and a whole one have one shape: free text is
one `message` item with one `output_text` part; a forced tool call (tool_choice `required`
or a named function: the grammar holds the text to compact JSON calls) is one
`function_call` item per call. An answer cut by `max_output_tokens` ends `incomplete`, its
last item too.

Stream events, in OpenAI's order, each with its `sequence_number`: `response.created`,
`response.in_progress`, then per item `response.output_item.added`; for a message
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`; for a call `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`; then `response.output_item.done`; at the end
`response.completed` (or `response.incomplete`), or `response.failed` with the error.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from lockgate.gateway.auto_calls import AutoCallReader
from lockgate.gateway.responses import Usage
from lockgate.gateway.responses_protocol import FunctionChoice, ResponsesRequest
from lockgate.gateway.tool_calls import ToolCallReader, ToolPlan


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def usage_object(u: Usage | None) -> dict[str, Any] | None:
    """A run's usage (the chat shape, as the usage row counts it) in the Responses API's shape."""
    if u is None:
        return None
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def event(kind: str, seq: int, **fields: Any) -> bytes:
    """One SSE event, named as its `type` (as OpenAI sends them)."""
    data = json.dumps({"type": kind, "sequence_number": seq, **fields}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class OutputWriter:
    """The output items of one answer, built from its text as it grows (`feed`, then
    `close`); each call returns the events (type, fields) that stream what changed. Under
    `auto` the calls read out of the text (gateway/auto_calls.py) are `function_call` items,
    each whole once recognized, between the message items of the text around them."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.items: list[dict[str, Any]] = []
        self.reader = ToolCallReader() if plan is not None and plan.forced else None
        self.auto = AutoCallReader(plan.names, plan.auto_max_calls) if plan is not None and plan.auto else None
        self._open: dict[str, Any] | None = None     # the item being written
        self._text = ""                                # the open message's text so far
        self.cut = False                               # by max_output_tokens

    def start(self) -> list[tuple[str, dict[str, Any]]]:
        """Free text: its message item opens at once (a model may write nothing)."""
        if self.reader is not None or self.auto is not None:
            return []
        return self._message()

    def _message(self) -> list[tuple[str, dict[str, Any]]]:
        out = self._end_item("completed")
        item = {"id": new_item_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        self._text = ""
        return [*out, *self._add(item), ("response.content_part.added", {
            "item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0, "part": text_part("")})]

    def _add(self, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.items.append(item)
        self._open = item
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)})]

    def _content(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        out = [] if self._open is not None and self._open["type"] == "message" else self._message()
        self._text += text
        return [*out, ("response.output_text.delta", {"item_id": self.items[-1]["id"],
                                                       "output_index": len(self.items) - 1, "content_index": 0,
                                                       "delta": text, "logprobs": []})]

    def _call(self, call_id: str, name: str) -> list[tuple[str, dict[str, Any]]]:
        out = self._end_item("completed")
        return out + self._add({"id": new_item_id("fc"), "type": "function_call", "status": "in_progress",
                                "call_id": call_id, "name": name, "arguments": ""})

    def _arguments(self, piece: str) -> list[tuple[str, dict[str, Any]]]:
        if self._open is None:
            return []
        self._open["arguments"] += piece
        return [("response.function_call_arguments.delta", {
            "item_id": self._open["id"], "output_index": len(self.items) - 1, "delta": piece})]

    def _auto(self, events: list[tuple[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for kind, value in events:
            if kind == "content":
                out += self._content(value)
            else:
                out += self._call(value["id"], value["function"]["name"])
                out += self._arguments(value["function"]["arguments"]) + self._end_item("completed")
        return out

    def feed(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        if self.auto is not None:
            return self._auto(self.auto.feed(text))
        if self.reader is None:
            return self._content(text)
        out: list[tuple[str, dict[str, Any]]] = []
        for d in self.reader.feed(text):
            if "id" in d:           # a new call: the one before it is complete
                out += self._call(d["id"], d["function"]["name"])
            else:
                out += self._arguments(d["function"]["arguments"])
        return out

    def close(self, finish_reason: str | None) -> list[tuple[str, dict[str, Any]]]:
        """The answer ended (`finish_reason` "length": cut by max_output_tokens)."""
        self.cut = finish_reason == "length"
        if self.auto is not None:
            out = self._auto(self.auto.finish())
            if not self.items:          # nothing written: one empty message, as for free text
                out += self._message()
            return out + self._end_item("incomplete" if finish_reason == "length" else "completed")
        return self._end_item("incomplete" if finish_reason == "length" else "completed")

    def _end_item(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        if item["type"] == "message":
            text = self._text
            item["content"] = [text_part(text)]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = [("response.output_text.done", {**where, "text": text, "logprobs": []}),
                   ("response.content_part.done", {**where, "part": text_part(text)})]
        else:
            out = [("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]})]
        return [*out, ("response.output_item.done", {"output_index": index, "item": dict(item)})]

    @property
    def incomplete(self) -> bool:
        return self.cut or (
            self.reader is not None and not self.items)


def response_object(head: dict[str, Any], status: str, output: list[dict[str, Any]],
                    usage: Usage | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Response object: the request's own fields (`head`, from `response_head`), its
    status, output, usage and error."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {**head, "status": status, "error": error, "incomplete_details": incomplete, "output": output,
            "usage": usage_object(usage)}


def response_head(req: ResponsesRequest, response_id: str, created: float, tier: str) -> dict[str, Any]:
    """What a Response object repeats of its request, as OpenAI's does (defaults filled in)."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": int(created), "background": False,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None, "model": req.model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": tier, "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                 "verbosity": "medium"},
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
        "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()],
        "top_logprobs": 0, "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
        "user": req.user, "metadata": req.metadata or {},
    }
