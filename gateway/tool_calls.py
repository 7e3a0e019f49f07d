"""Tool calls: the tools in the prompt, the grammar that forces a call, and the calls read
back out of the output in OpenAI's shape (whole, or as streamed `delta.tool_calls`).

A call is written as compact JSON, `{"name": <function name>, "arguments": <arguments>}`,
or a list of them when parallel calls are allowed. With `tool_choice` `required` or a named
function, decoding is held to exactly that (`ToolPlan.schema`: each tool's own parameters
schema for its arguments), so the answer parses into `tool_calls` (cut by max_tokens: the
calls so far, finish_reason "length", streamed or not). With `auto`, decoding is free and
calls are read out of the text (gateway/auto_calls.py); the rest is `content`. With `none`,
the tools are not shown to the model.

Prompts: a chat template that renders `tools` (HF's `tools=`) gets them, and the
conversation's assistant `tool_calls` and `tool` messages as they are. Otherwise the tools
and the call format are described in a system message (`TOOLS_HEADER`, then one JSON line
per function), added first or appended to the conversation's first system message, and an
assistant message's calls are written into its content in the same JSON format.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from lockgate.gateway.auto_calls import new_call_id, read_auto
from lockgate.gateway.errors import APIError
from lockgate.gateway.protocol import ChatMessage, Tool

MAX_PARALLEL_CALLS = 8      # a parallel answer's calls: at most this many (keeps the grammar bounded)
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
TOOLS_HEADER = "# Tools\n\nYou may call these functions. Each is given as JSON, with a JSON schema of its arguments:"
_HEAD = re.compile(r'\{"name":"([A-Za-z0-9_-]{1,64})","arguments":')


@dataclass(slots=True, frozen=True)
class ToolPlan:
    """The request's tools and how the answer may use them."""

    tools: list[Tool]
    choice: str                  # "none", "auto", "required", or the name of the function to call
    parallel: bool

    @property
    def forced(self) -> bool:
        """Is the answer held to tool calls (`required` or a named function)?"""
        return self.choice not in ("none", "auto")

    @property
    def auto(self) -> bool:
        """Is the answer free text that calls are read out of (`auto`)?"""
        return self.choice == "auto"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools)

    @property
    def auto_max_calls(self) -> int:
        """Under `auto`, the calls an answer may make: one unless parallel calls are allowed."""
        return MAX_PARALLEL_CALLS if self.parallel else 1

    @property
    def parallel_calls(self) -> bool:
        return self.parallel and self.choice == "required"

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a forced answer: one call of the named function or of any tool,
        or with parallel calls a list of 1..MAX_PARALLEL_CALLS. Each tool's parameters sit in
        `$defs` (their own `$ref`s rebased there), so a schema with references keeps working."""
        tools = [(i, t) for i, t in enumerate(self.tools) if self.choice in ("required", t.function.name)]
        defs = {f"tool{i}": closed(rebase_refs(parameters_of(t), f"#/$defs/tool{i}"), t.function.strict is True)
                for i, t in tools}
        calls = [{"type": "object",
                  "properties": {"name": {"const": t.function.name}, "arguments": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for i, t in tools]
        one: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.parallel_calls:
            return {"$defs": defs, "type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}
        return {"$defs": defs, **one}


def parameters_of(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


_NOT_SCHEMAS = ("enum", "const", "default", "examples")     # values, not subschemas


def closed(schema: Any, strict: bool) -> Any:
    """A forced call's arguments schema with every object closed, so that decoding ends the
    object: extra keys only where the schema itself allows them (`additionalProperties`
    given), and with `strict` (OpenAI's strict mode) none at all and every property required."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "object" or isinstance(node.get("properties"), dict):
                if strict:
                    node["additionalProperties"] = False
                    node["required"] = list(node.get("properties") or {})
                else:
                    node.setdefault("additionalProperties", False)
            stack.extend(v for k, v in node.items() if k not in _NOT_SCHEMAS)
        elif isinstance(node, list):
            stack.extend(node)
    return out


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` whose local references (`#`, `#/...`) point into it at `base`."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                node["$ref"] = base + ref[1:]
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def tool_plan(tools: list[Tool] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's plan (None without tools); a 400 for a choice that names no tool."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice: only allowed when tools are given", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    choice = "auto" if tool_choice is None else tool_choice
    if not isinstance(choice, str):
        choice = choice.function.name
        if choice not in names:
            raise APIError(400, f"tool_choice: no tool is named {choice!r}", param="tool_choice.function.name")
    return ToolPlan(list(tools), choice, parallel_tool_calls is not False)


# -- the prompt ----------------------------------------------------------------------------------
def prompt_messages(messages: list[ChatMessage], plan: ToolPlan | None,
                    template_renders_tools: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation as the chat template takes it, and the tools for its `tools=` (None
    when the template does not render them: they are in a system message then)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if template_renders_tools:
                msg["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)}}
                                     for c in m.tool_calls]
            else:
                written = calls_text([(c.function.name, c.function.arguments) for c in m.tool_calls])
                msg["content"] = f"{msg['content']}\n{written}" if msg["content"] else written
        out.append(msg)
    if plan is None or plan.choice == "none":
        return out, None
    if template_renders_tools:
        return out, [t.model_dump(exclude_none=True, by_alias=True) for t in plan.tools]
    text = tools_text(plan)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out, None


def tools_text(plan: ToolPlan) -> str:
    lines = [TOOLS_HEADER]
    for t in plan.tools:
        f = t.function
        entry = {"name": f.name, **({"description": f.description} if f.description else {}),
                 "parameters": parameters_of(t)}
        lines.append(json.dumps(entry, ensure_ascii=False))
    how = ('To call a function, answer with only a JSON object: {"name": <function name>, '
           '"arguments": <its arguments>}')
    if plan.parallel_calls or (plan.choice == "auto" and plan.parallel):
        how += "; to call several, a JSON list of such objects"
    lines += ["", how + "."]
    if plan.forced:
        lines.append(f"You must call {'a function' if plan.choice == 'required' else plan.choice} now.")
    return "\n".join(lines)


def calls_text(calls: list[tuple[str, str]]) -> str:
    """Calls written the way the model is asked to write them."""
    items = [f'{{"name":{json.dumps(name)},"arguments":{arguments}}}' for name, arguments in calls]
    return items[0] if len(items) == 1 else "[" + ",".join(items) + "]"


def _loads(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# -- the answer ----------------------------------------------------------------------------------
@dataclass(slots=True)
class ToolCallReader:
    """Reads a forced answer's text (compact JSON, as the grammar writes it) as it grows:
    `feed` returns OpenAI's `delta.tool_calls` entries for the new text (a call's id, type
    and name once its name is complete, then pieces of its arguments' text); `calls` holds
    the calls read so far, name and arguments text."""

    calls: list[list[str]] = field(default_factory=list)    # [name, arguments text so far]
    ids: list[str] = field(default_factory=list)
    _phase: str = "between"      # between calls, in a call's head, or in its arguments
    _head: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        args: list[str] = []
        for ch in text:
            if self._phase == "between":
                if ch == "{":
                    self._phase, self._head = "head", ch
            elif self._phase == "head":
                self._head += ch
                m = _HEAD.fullmatch(self._head)
                if m:
                    self._phase, self._depth = "args", 0
                    self.calls.append([m.group(1), ""])
                    self.ids.append(new_call_id())
                    deltas.append({"index": len(self.calls) - 1, "id": self.ids[-1], "type": "function",
                                   "function": {"name": m.group(1), "arguments": ""}})
            elif self._arguments_end(ch):
                self._flush(args, deltas)
                self._phase = "between"
            else:
                args.append(ch)
        self._flush(args, deltas)
        return deltas

    def _arguments_end(self, ch: str) -> bool:
        """Track strings and nesting in the arguments; True at the `}` that closes the call."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            if self._depth == 0:
                return True
            self._depth -= 1
        return False

    def _flush(self, args: list[str], deltas: list[dict[str, Any]]) -> None:
        if args:
            piece = "".join(args)
            self.calls[-1][1] += piece
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            args.clear()

    def tool_calls(self) -> list[dict[str, Any]]:
        return [{"id": i, "type": "function", "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in zip(self.ids, self.calls, strict=True)]


def read_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """A complete forced answer's calls in OpenAI's shape; None if `text` is not one (cut
    short by max_tokens or a stop string)."""
    try:
        json.loads(text)
    except ValueError:
        return None
    reader = ToolCallReader()
    reader.feed(text)
    return reader.tool_calls() or None


def chat_message(text: str, finish_reason: str | None, plan: ToolPlan | None) -> tuple[dict[str, Any], str | None]:
    """A choice's message and finish reason, as its stream gives them (serving/chat.py
    `chat_chunks`): a forced answer is its calls (`content` null; finish_reason "tool_calls"
    once complete, else "length": the calls read so far, the last one's arguments cut short);
    under `auto`, the calls read out of the text (gateway/auto_calls.py) and the rest as
    content; anything else is text."""
    if plan is not None and plan.forced:
        complete = finish_reason == "stop" and read_tool_calls(text) is not None
        reader = ToolCallReader()
        reader.feed(text)
        message: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None}
        if reader.calls:
            message["tool_calls"] = reader.tool_calls()
        return message, "tool_calls" if complete else finish_reason
    if plan is not None and plan.auto:
        content, calls = read_auto(text, plan.names, plan.auto_max_calls)
        if calls:
            return ({"role": "assistant", "content": content or None, "refusal": None, "tool_calls": calls},
                    "tool_calls" if finish_reason == "stop" else finish_reason)
    return {"role": "assistant", "content": text, "refusal": None}, finish_reason
