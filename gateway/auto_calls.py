"""Tool calls read out of free text, for `tool_choice` `auto` (decoding is not held to calls).

Two formats are recognized: the one the prompt describes when the template has no place for
tools (gateway/tool_calls.py `tools_text`: a JSON object `{"name": ..., "arguments": {...}}`,
or a JSON list of them, as the whole output or right after another call), and the chat
templates' own `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen,
Hermes), anywhere in the text. A call counts only when it is well formed: a declared tool's
name and arguments that are a JSON object (or a string holding one); anything else, a
malformed block or an undeclared name included, stays content, as written.

`AutoCallReader.feed` takes the text as it grows and returns what is settled: content pieces
and whole calls. Text that may still be the start of a call (a `<tool_call` prefix at the
end, an open block, a JSON value that may be a call) is held back until it is settled, and
released as content once it cannot be a call (or at `finish`, whatever it is then). A call
is given whole once recognized: its id, name and arguments in one `delta.tool_calls` entry.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_HELD_CHARS = 64 * 1024        # past this much held text, a would-be call is released as content
MAX_CALLS = 8                     # a JSON list of calls: at most this many
_HEADS = ('{"name"', '[{"name"', '{"arguments"', '[{"arguments"')
_SPACE = re.compile(r"\s+")

Event = tuple[str, Any]           # ("content", text) or ("call", OpenAI's tool call)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def json_end(text: str) -> int | None:
    """The index just past the JSON value (object or list) `text` starts with; None while
    its brackets are still open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def may_be_call(text: str) -> bool:
    """Can `text` (a JSON value begun) still become a call? Its start, whitespace aside."""
    squeezed = _SPACE.sub("", text[:80])
    return any(head.startswith(squeezed) or squeezed.startswith(head) for head in _HEADS)


def partial_open(text: str) -> int:
    """How many characters at the end of `text` may be the start of `<tool_call>`."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


@dataclass(slots=True)
class AutoCallReader:
    names: frozenset[str]                      # the declared tools
    # parallel_tool_calls false: one; a call past this many stays content, as written
    max_calls: int = MAX_CALLS
    calls: list[dict[str, Any]] = field(default_factory=list)
    _held: str = ""
    _at_start: bool = True                     # at the output's start or just after a call

    def feed(self, text: str) -> list[Event]:
        self._held += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """The end of the output: whatever is still held is settled now."""
        return self._drain(final=True)

    def _call(self, value: Any) -> dict[str, Any] | None:
        if not isinstance(value, dict) or set(value) not in ({"name", "arguments"}, {"name", "parameters"}):
            return None
        name, arguments = value["name"], value.get("arguments", value.get("parameters"))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if name not in self.names or not isinstance(arguments, dict):
            return None
        return {"id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}

    def _calls_of(self, text: str) -> list[dict[str, Any]] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        values = value if isinstance(value, list) and 0 < len(value) <= MAX_CALLS else [value]
        calls = [self._call(v) for v in values]
        if None in calls or len(self.calls) + len(calls) > self.max_calls:
            return None
        return [c for c in calls if c is not None]

    def _settle(self, out: list[Event], content: str, calls: list[dict[str, Any]] | None, rest: str) -> None:
        if calls:
            self.calls += calls
            out += [("call", c) for c in calls]
            self._at_start = True
        elif content:
            out.append(("content", content))
            self._at_start = False
        self._held = rest

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._held:
            h = self._held
            s = h.lstrip()
            if self._at_start and not s:                # only whitespace so far
                if final:
                    self._settle(out, "" if self.calls else h, None, "")
                break
            if self._at_start and s[0] in "{[":           # a bare JSON call?
                end = json_end(s)
                if end is None:
                    if not final and may_be_call(s) and len(s) <= MAX_HELD_CHARS:
                        break
                    self._at_start = False
                    continue
                calls = self._calls_of(s[:end])
                self._settle(out, "" if calls else h[:len(h) - len(s) + end], calls, s[end:])
                continue
            if self._at_start and self.calls and s.startswith("<"):
                h = self._held = s                        # whitespace between calls is not content
            if self._block(out, h, final):
                break
        return out

    def _block(self, out: list[Event], h: str, final: bool) -> bool:
        """The tag format on held text `h`; True when nothing more can be settled now."""
        i = h.find(OPEN)
        if i < 0:
            keep = 0 if final else partial_open(h)
            self._settle(out, h[:len(h) - keep], None, h[len(h) - keep:])
            return True
        if i > 0:
            self._settle(out, h[:i], None, h[i:])
            return False
        j = h.find(CLOSE, len(OPEN))
        if j < 0:
            if final or len(h) > MAX_HELD_CHARS:
                self._settle(out, h, None, "")
            return True
        inner = h[len(OPEN):j].strip()
        calls = self._calls_of(inner) if inner.startswith("{") else None
        self._settle(out, "" if calls else h[:j + len(CLOSE)], calls and calls[:1], h[j + len(CLOSE):])
        return False


def read_auto(text: str, names: frozenset[str], max_calls: int = MAX_CALLS) -> tuple[str, list[dict[str, Any]]]:
    """A whole output's content (what is not a call) and its calls."""
    reader = AutoCallReader(names, max_calls)
    events = reader.feed(text) + reader.finish()
    return "".join(v for kind, v in events if kind == "content"), reader.calls
