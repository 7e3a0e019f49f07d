"""OpenAI request bodies: read from the wire (`read_json`: content type, UTF-8, nesting depth,
lone surrogates) and checked field by field (`parse`), with JSON's types kept strict.

Unknown fields are refused (as OpenAI does: "Unrecognized request argument supplied"), and
OpenAI fields that Lockgate does not implement are refused by name, never ignored.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from typing import Annotated, Any, Literal, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator
from starlette.requests import ClientDisconnect

from lockgate.gateway.errors import APIError, validation_error
from lockgate.gateway.fields import INT64_MAX, INT64_MIN, Ident

logger = logging.getLogger(__name__)

# JSON's own types, strictly: `true` is not the integer 1 (an integer is still a valid float);
# an integer inside 64 bits, as everything downstream (the limiter, the database) counts
Int = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]

# OpenAI fields Lockgate does not implement: refused when set to anything but null (the
# README's list of fields Lockgate cannot honour).
UNSUPPORTED_CHAT = (
    "functions", "function_call", "audio", "modalities", "prediction", "reasoning_effort",
    "web_search_options", "verbosity",
)
UNSUPPORTED_COMPLETION = ("suffix", "best_of", "echo")

# neutral values of unsupported completion fields that clients send by default
_NEUTRAL = {"best_of": (1,), "echo": (False,)}


B = TypeVar("B", bound=BaseModel)


def refuse_unsupported(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if name in body and body[name] is not None and body[name] not in _NEUTRAL.get(name, ()):
            raise APIError(400, f"{name} is not supported by Lockgate", param=name,
                           code="unsupported_parameter")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    parsed_arguments: Any = None    # the openai client's parse() adds it to messages sent back; ignored


class ToolCall(_Strict):
    """A call an assistant message made, sent back in the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)   # assistant messages
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=256)   # tool messages
    refusal: str | None = None      # as the API returns assistant messages; not rendered
    parsed: Any = None              # the openai client's parse() adds it to messages sent back; ignored

    @model_validator(mode="after")
    def _check_tool_fields(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only assistant messages carry tool calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("tool_call_id: required on tool messages, and only there")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema; none: no arguments
    strict: Bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    strict: Bool | None = None      # accepted here too; OpenAI's place is json_schema.strict

    @model_validator(mode="after")
    def _check_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema: required with type json_schema, and only then")
        return self


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a choice."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None


MAX_LOGIT_BIAS = 300        # OpenAI's own bound on the entries of `logit_bias`
# the chat template's own arguments, which a request's `chat_template_kwargs` may not replace
_TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "sanitize_control_tokens", "self",
    "bos_token", "eos_token",
})
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class SamplingBody(_Strict):
    """The sampling fields chat and completions share (OpenAI's and vLLM's)."""

    model: Ident = Field(min_length=1, max_length=256)
    temperature: Float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: Float | None = Field(default=None, gt=0.0, le=1.0)
    n: Int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=-(2**63), lt=2**63)
    presence_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, for its users
    top_k: Int | None = Field(default=None, ge=-1)
    min_p: Float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(default=None, gt=0.0, le=10.0)
    min_tokens: Int | None = Field(default=None, ge=0)
    ignore_eos: Bool | None = None
    cache_salt: str | None = Field(default=None, max_length=256)
    # structured outputs (gateway/structured.py): OpenAI's, then vLLM's
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    structured_outputs: StructuredOutputsBody | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = Field(default=None, max_length=64)
    skip_special_tokens: Bool | None = None
    include_stop_str_in_output: Bool | None = None
    # smaller runs sooner, among this tenant's own requests of its class (never past another
    # tenant's: the engine orders by class, then tenant fairness, then this)
    priority: Int | None = Field(default=None, ge=-(2**31), lt=2**31)
    # Lockgate's: false keeps this request's decodes to one token a step where the engine
    # speculates (the output is the same either way; drafts cost compute)
    speculative: Bool | None = None
    # token id (as a string, as OpenAI's clients send it) -> a bias added to its logit
    logit_bias: dict[str, Float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # OpenAI's fields that ask nothing of the model: accepted, checked as OpenAI does, kept
    # nowhere (README: "Fields accepted and not acted on")
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    store: Bool | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _check_stop(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop: stop sequences must be non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats \
                and not self.stream_options.include_usage:
            raise ValueError("stream_options.continuous_usage_stats: requires include_usage to be true")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not token.isascii() or not token.isdigit() or len(token) > 9:
                raise ValueError(f"key {token[:20]!r} is not a token id (a non-negative integer)")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {token} must be in [-100, 100], got {bias!r}")
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` as the engine takes it: {token id: bias}."""
        return {int(t): b for t, b in self.logit_bias.items()} if self.logit_bias else None


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(default=None, ge=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool | None = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None
    # vLLM's: the chat template's generation prompt (false: the prompt ends with the last
    # message), and the template's own variables (`enable_thinking`, say)
    add_generation_prompt: Bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=32)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in value or {}:
            if not _NAME.match(name) or name in _TEMPLATE_RESERVED:
                raise ValueError(f"{name[:64]!r} is not a template variable a request may set")
        return value

    def template_options(self) -> dict[str, Any] | None:
        """What the chat template is rendered with beyond the messages and tools: its variables
        and whether it ends with the generation prompt; None when the request sets neither."""
        options = dict(self.chat_template_kwargs or {})
        if self.add_generation_prompt is not None:
            options["add_generation_prompt"] = self.add_generation_prompt
        return options or None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(default=16, ge=1)
    logprobs: Int | None = Field(default=None, ge=0, le=5)
    echo: Bool | None = False
    best_of: Int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        ids = [x for x in p if isinstance(x, int)]    # the list is of one kind (validated)
        if ids and len(ids) == len(p):
            return [ids]              # one prompt of token ids
        return [x for x in p if not isinstance(x, int)]   # several prompts: strings or id lists


# -- reading a body ---------------------------------------------------------------------------------
MAX_JSON_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.S)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (an upper bound when it is not valid
    JSON), counted in a loop, not by recursion: strings dropped, then the brackets summed."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0          # too few brackets to go past the limit, however they nest
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    return max(itertools.accumulate(_STEP[b] for b in brackets))


def lone_surrogate_at(data: Any) -> str | None:
    """The field (`messages[0].content`) of the first string or key holding a lone surrogate
    (JSON's `\\ud800` escapes: not a character, so no tokenizer or database takes it)."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if not _utf8(k):
                    return path or k
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, str) and not _utf8(value):
            return path
    return None


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_content_type(value: str | None) -> None:
    """JSON in UTF-8 (`application/json`, `application/*+json`); no header is taken as JSON."""
    if value is None:
        return
    media, _, params = value.partition(";")
    media = media.strip().lower()
    charset = next((p.split("=", 1)[1].strip().strip('"').lower() for p in params.split(";")
                    if p.strip().lower().startswith("charset=")), "utf-8")
    if not (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))) \
            or charset not in ("utf-8", "utf8"):
        raise APIError(415, f"content-type: expected application/json in UTF-8, got {value[:100]!r}",
                       param="content-type", code="unsupported_media_type")


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: content type, UTF-8, depth (`MAX_JSON_DEPTH`) and lone
    surrogates checked, each a 400 (415 for the content type) saying which."""
    check_content_type(request.headers.get("content-type"))
    try:
        body = await request.body()
    except ClientDisconnect:
        logger.info("client left during the upload of %s %s", request.method, request.url.path)
        raise APIError(499, "client closed the request", code="client_closed_request") from None
    if not body:
        raise APIError(400, "The request body is empty; expected a JSON object.")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not UTF-8: {exc}", param="content-type") from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"The JSON body is nested too deeply (more than {MAX_JSON_DEPTH} levels).")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    if _SURROGATE_ESCAPE.search(body) and (where := lone_surrogate_at(data)) is not None:
        raise APIError(400, f"{where}: holds a lone UTF-16 surrogate, which is not a character",
                       param=where)
    return data


def parse(model: type[B], data: dict[str, Any]) -> B:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None
