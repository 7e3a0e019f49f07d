"""Anthropic's Messages API bodies (`POST /v1/messages`, `/v1/messages/count_tokens`): read
and checked as strictly as the OpenAI ones (gateway/protocol.py: unknown fields refused, JSON's
types kept strict), then written as the chat completion they ask for (`chat_body`), so that a
message runs through the same template, tools, grammar and sampling as chat does.

What Lockgate cannot honour is refused by name, a 400 in Anthropic's shape
(gateway/anthropic_errors.py): extended `thinking`, images and documents, server-side tools
(web search, code execution, computer use...), `container`, `mcp_servers`, `context_management`.
Accepted and not needed: `cache_control`, on blocks or the request (the engine's prefix cache
is automatic, per tenant),
`metadata`, `citations: null`, `thinking: {"type": "disabled"}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict

from lockgate.gateway.errors import APIError
from lockgate.gateway.fields import INT64_MAX, Ident
from lockgate.gateway.protocol import FUNCTION_NAME

Int = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]

# top-level fields Lockgate cannot honour: refused when set (and not to a neutral value)
UNSUPPORTED_MESSAGES = ("thinking", "container", "mcp_servers", "context_management", "output_format",
                        "output_config", "inference_geo")
_NEUTRAL: dict[str, tuple[Any, ...]] = {"thinking": ({"type": "disabled"},)}
# content blocks Lockgate cannot read or write
UNSUPPORTED_BLOCKS = ("image", "document", "search_result", "thinking", "redacted_thinking",
                      "server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                      "code_execution_tool_result", "bash_code_execution_tool_result",
                      "text_editor_code_execution_tool_result", "mcp_tool_use", "mcp_tool_result",
                      "container_upload", "tool_search_tool_result")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class Caller(_Strict):
    type: Literal["direct"]     # the model called it (code execution's calls are server-side)


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Caller | None = None     # as the client sends an answer's blocks back
    toolset_name: None = None        # MCP toolsets: not supported


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: Bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or [])
        return f"Error: {body}" if self.is_error else body


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, pattern=FUNCTION_NAME)
    disable_parallel_tool_use: Bool | None = None


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=256)


class CountTokensRequest(_Strict):
    """`POST /v1/messages/count_tokens`: what a message's prompt is, without its sampling."""

    model: Ident = Field(min_length=1, max_length=256)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None      # refused unless disabled (UNSUPPORTED_MESSAGES)
    cache_control: CacheControl | None = None   # the engine's prefix cache is automatic: not needed


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`."""

    max_tokens: Int = Field(ge=1)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    stream: Bool | None = False
    temperature: Float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int | None = Field(default=None, ge=1)
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speculative: Bool | None = None      # Lockgate's, as chat's: false decodes without drafts


def refuse_unsupported(data: dict[str, Any]) -> None:
    """400 naming the first field, content block or tool Lockgate cannot honour."""
    for name in UNSUPPORTED_MESSAGES:
        if data.get(name) is not None and data[name] not in _NEUTRAL.get(name, ()):
            raise APIError(400, f"{name}: is not supported by Lockgate", param=name, code="unsupported_parameter")
    for i, m in enumerate(data.get("messages") or []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            inner = block.get("content") if kind == "tool_result" else None
            kinds = [(f"messages[{i}].content[{j}].type", kind)] + [
                (f"messages[{i}].content[{j}].content[{k}].type", b.get("type"))
                for k, b in enumerate(inner if isinstance(inner, list) else []) if isinstance(b, dict)]
            for param, what in kinds:
                if what in UNSUPPORTED_BLOCKS:
                    raise APIError(400, f"{param}: {what!r} content blocks are not supported by Lockgate",
                                   param=param, code="unsupported_parameter")
    for i, tool in enumerate(data.get("tools") or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise APIError(400, f"tools[{i}].type: server tool {kind!r} is not supported by Lockgate; "
                           "only client tools (name, description, input_schema)", param=f"tools[{i}].type",
                           code="unsupported_parameter")


# -- as a chat completion --------------------------------------------------------------------------
def system_text(system: str | list[TextBlock] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    return "\n".join(b.text for b in system) or None


def chat_messages(req: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt first; a user turn's tool results
    each a `tool` message (before the turn's text, as they answer the previous turn's calls);
    an assistant turn's text and its calls one assistant message."""
    out: list[dict[str, Any]] = []
    system = system_text(req.system)
    if system is not None:
        out.append({"role": "system", "content": system})
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            out.append({"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})})
            continue
        out += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
                for b in blocks if isinstance(b, ToolResultBlock)]
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    return out


def chat_tools(req: CountTokensRequest) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` as chat's (any: required; tool: that
    function; none: the tools are not shown)."""
    if not req.tools:
        if req.tool_choice is not None and req.tool_choice.type not in ("auto", "none"):
            raise APIError(400, "tool_choice: only allowed when tools are given", param="tool_choice")
        return {}
    tools = [{"type": "function", "function": {"name": t.name, **({"description": t.description}
                                                                 if t.description else {}),
                                               "parameters": t.input_schema}} for t in req.tools]
    c = req.tool_choice
    choice: Any = "auto" if c is None else {"auto": "auto", "any": "required", "none": "none"}.get(c.type)
    if c is not None and c.type == "tool":
        if c.name is None:
            raise APIError(400, "tool_choice.name: required with type tool", param="tool_choice.name")
        choice = {"type": "function", "function": {"name": c.name}}
    parallel = None if c is None or c.disable_parallel_tool_use is None else not c.disable_parallel_tool_use
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}


def chat_body(req: MessagesRequest, model: str) -> dict[str, Any]:
    """The chat completion body `req` asks for, on the served `model`."""
    body: dict[str, Any] = {"model": model, "messages": chat_messages(req), "max_tokens": req.max_tokens,
                            **chat_tools(req)}
    for name in ("temperature", "top_p", "top_k", "speculative"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    return body
