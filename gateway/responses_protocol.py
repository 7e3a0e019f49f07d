"""The Responses API's request body (`POST /v1/responses`), read and checked: types strict,
unknown fields refused, every error a 400 naming the field as the client wrote it
(`input[2].call_id`, `tools[0].parameters`, `text.format.schema`).

What Lockgate cannot honour is refused by name, never ignored: running in the `background`,
built-in tools (`web_search`, `file_search`, ...), images, files and audio in the input,
`reasoning`, stored `prompt`s and `conversation`s, `truncation: auto`, `include`, logprobs.
Harmless fields are accepted: `metadata` (kept with the response), `user`,
`safety_identifier`, `prompt_cache_key`, `prompt_cache_retention`, `stream_options`.

`parse_request` returns the body and its input as items, each checked by its own model
(`message`, `function_call`, `function_call_output`), so an error names the item by index.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lockgate.gateway.errors import APIError, validation_error
from lockgate.gateway.fields import Ident
from lockgate.gateway.protocol import FUNCTION_NAME, Bool, Float, Int

# field -> (values that mean "not used", why it is refused)
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "Lockgate does not run responses in the background"),
    "conversation": ((), "stored conversations are not supported; use previous_response_id"),
    "prompt": ((), "stored prompts are not supported"),
    "reasoning": ((), "reasoning options are not supported"),
    "include": (([],), "extra output data is not supported"),
    "top_logprobs": ((0,), "logprobs are not supported in the Responses API"),
    "max_tool_calls": ((), "built-in tool calls are not supported"),
    "truncation": (("disabled",), "truncation 'auto' is not supported; only 'disabled'"),
}
ITEM_TYPES = ("message", "function_call", "function_call_output")
PART_TYPES = ("input_text", "output_text", "refusal")
_MEDIA = {"input_image": "images", "input_file": "files", "input_audio": "audio"}
MAX_ITEMS = 4096
Id = Annotated[Ident, Field(min_length=1, max_length=256)]
Status = Literal["in_progress", "completed", "incomplete"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class OutputText(_Strict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    parsed: Any = None          # the openai client's parse() adds it to items sent back; ignored


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | OutputText | Refusal, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: Id | None = None
    status: Status | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, Refusal) else p.text for p in self.content)


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Id
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str
    id: Id | None = None
    status: Status | None = None
    parsed_arguments: Any = None    # the openai client's parse() adds it; ignored


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Id
    output: str | list[InputText]
    id: Id | None = None
    status: Status | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=FUNCTION_NAME)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: Bool | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("json_schema: name and schema are required")
        return self


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: Bool | None = None


class ResponsesRequest(_Strict):
    model: Ident = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]] = Field(
        max_length=MAX_ITEMS, description="A user message's text, or items: `message` (role, content as text or "
        "`input_text`/`output_text` parts), `function_call` (call_id, name, arguments), `function_call_output` "
        "(call_id, output)")
    instructions: str | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(
        default=None, max_length=128,
        description="Function tools: {type: function, name, description, parameters, strict}")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: Bool | None = None
    text: TextConfig | None = None
    previous_response_id: Id | None = None
    store: Bool | None = True
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    prompt_cache_retention: Literal["in-memory", "24h"] | None = None
    speculative: Bool | None = None      # Lockgate's, as chat's: false decodes without drafts
    # refused unless neutral (`UNSUPPORTED`), declared so that the schema shows them
    background: Bool | None = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: list[str] | None = None
    top_logprobs: Int | None = None
    max_tool_calls: Int | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def check(self) -> None:
        """What one field alone cannot say: a 400 naming the field."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
        if not self.input and (isinstance(self.input, str) or self.previous_response_id is None):
            raise APIError(400, "input: must not be empty", param="input")

    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or []]


def unsupported(name: str, why: str, param: str | None = None) -> APIError:
    return APIError(400, f"{param or name}: {why}", param=param or name, code="unsupported_parameter")


def refuse_unsupported(data: dict[str, Any]) -> None:
    """A 400 naming the first field, tool, item or content part Lockgate cannot honour."""
    for name, (neutral, why) in UNSUPPORTED.items():
        if data.get(name) is not None and data[name] not in neutral:
            raise unsupported(name, why)
    tools = data.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise unsupported("tools", f"{kind!r} tools are not supported; only 'function'", f"tools[{i}].type")
    choice = data.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("type"), str) and choice["type"] != "function":
        raise unsupported("tool_choice", f"{choice['type']!r} is not supported", "tool_choice.type")
    items = data.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        _refuse_item(item, i)


def _refuse_item(item: Any, i: int) -> None:
    if not isinstance(item, dict):
        return
    kind = item.get("type", "message")
    if isinstance(kind, str) and kind not in ITEM_TYPES:
        raise unsupported("input", f"{kind!r} items are not supported (only {', '.join(ITEM_TYPES)})",
                          f"input[{i}].type")
    parts = item.get("content") if kind == "message" else item.get("output")
    field = "content" if kind == "message" else "output"
    for j, part in enumerate(parts if isinstance(parts, list) else []):
        ptype = part.get("type") if isinstance(part, dict) else None
        if isinstance(ptype, str) and ptype not in PART_TYPES:
            what = _MEDIA.get(ptype, f"{ptype!r} parts")
            raise unsupported("input", f"{what} are not supported; only text",
                              f"input[{i}].{field}[{j}].type")


def _in_data(loc: tuple[Any, ...], data: Any, kind: str) -> tuple[Any, ...]:
    """`loc` as a path in `data`: the labels pydantic adds for a union's members (`str`,
    `list[...]`, a tag) left out; a missing or unknown field's name kept."""
    out: list[Any] = []
    for n, seg in enumerate(loc):
        in_dict = isinstance(data, dict) and isinstance(seg, str) and seg in data
        if in_dict or (isinstance(data, list) and isinstance(seg, int) and 0 <= seg < len(data)):
            out.append(seg)
            data = data[seg]
        elif n == len(loc) - 1 and kind in ("missing", "extra_forbidden"):
            out.append(seg)
    return tuple(out)


def _invalid(exc: ValidationError, data: Any, *prefix: str | int) -> APIError:
    """A 400 naming the field of the most specific error (a union's members each fail)."""
    located = [(("body", *prefix, *_in_data(e["loc"], data, e["type"])), e) for e in exc.errors()]
    located.sort(key=lambda le: -len(le[0]))
    return validation_error(RequestValidationError([{**e, "loc": loc} for loc, e in located]))


def parse_request(data: dict[str, Any]) -> tuple[ResponsesRequest, list[Item]]:
    """The body and its input items, checked (see the module's docstring)."""
    refuse_unsupported(data)
    try:
        req = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, data) from None
    req.check()
    for i, tool in enumerate(req.tools or []):
        try:
            FunctionTool.model_validate(tool)
        except ValidationError as exc:
            raise _invalid(exc, tool, "tools", i) from None
    if isinstance(req.input, str):
        return req, [MessageItem(role="user", content=req.input)]
    items: list[Item] = []
    for i, raw in enumerate(req.input):
        kind = raw.get("type", "message")
        model = _ITEM_MODELS.get(kind, MessageItem) if isinstance(kind, str) else MessageItem
        try:
            items.append(model.model_validate(raw))   # type: ignore[arg-type]
        except ValidationError as exc:
            raise _invalid(exc, raw, "input", i) from None
    return req, items
