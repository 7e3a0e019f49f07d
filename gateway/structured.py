"""Structured outputs at the HTTP edge: what a request's output must match, as the engine's
`StructuredOutputsParams`, checked before the engine sees it.

The constraint comes from one of OpenAI's `response_format` (`json_object`, `json_schema`;
constrained whether `strict` is set or not), a `tool_choice` that forces a call
(gateway/tool_calls.py), or vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`structured_outputs`; two at once are a 400. Each schema is checked here: its size (at most
`max_schema_bytes` of JSON), then compiled through the process's grammar cache, waiting at
most `grammar_compile_timeout_s` (the compile runs on the cache's threads, not the event
loop), its first mask included: a pattern that expands too far or whose first mask costs
too much is refused there (engine/grammar_limits.py). A bad, large, slow or too complex
schema is a 400 naming its field (`response_format.json_schema.schema`, `guided_regex`,
`tools[0].function.parameters`). The compile is charged to the caller's tenant
(`grammar_owner`, set where the request is admitted), so one tenant's specs cannot push
everyone else's out of the cache. An engine in this process then finds the grammar
compiled; a pool's workers compile it again from their own cache.
"""

from __future__ import annotations

import asyncio
import json
from contextvars import ContextVar
from typing import Any

from lockgate.engine import (
    GrammarError,
    GrammarTooComplex,
    InvalidRequest,
    StructuredOutputsParams,
    grammar_compiler,
)
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_catalog import ModelInfo
from lockgate.gateway.protocol import SamplingBody
from lockgate.gateway.settings import Settings
from lockgate.gateway.tool_calls import ToolPlan, parameters_of

# the tenant a compile is charged to in the grammar cache (set per request by the serving path)
grammar_owner: ContextVar[str] = ContextVar("grammar_owner", default="default")


def requested(req: SamplingBody) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint the request's structured-output fields ask for, with the field that
    asked; None for none. 400 when two ask, or one is malformed."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append((_spec("response_format", json_object=True), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        schema = rf.json_schema.schema_ if rf.json_schema is not None else None
        if schema is None:
            raise APIError(400, f"{param}: required with type json_schema", param=param)
        found.append((_spec(param, json=schema), param))
    if req.guided_json is not None:
        found.append((_spec("guided_json", json=_schema(req.guided_json, "guided_json")), "guided_json"))
    if req.guided_regex is not None:
        found.append((_spec("guided_regex", regex=req.guided_regex), "guided_regex"))
    if req.guided_choice is not None:
        found.append((_spec("guided_choice", choice=req.guided_choice), "guided_choice"))
    so = req.structured_outputs
    if so is not None:
        set_ = [k for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice)) if v is not None]
        if len(set_) != 1:
            raise APIError(400, "structured_outputs: set exactly one of json, regex, choice",
                           param="structured_outputs")
        param = f"structured_outputs.{set_[0]}"
        value = _schema(so.json_, param) if so.json_ is not None else getattr(so, set_[0])
        found.append((_spec(param, **{set_[0]: value}), param))
    if len(found) > 1:
        raise APIError(400, f"{found[1][1]}: cannot be combined with {found[0][1]}", param=found[1][1])
    return found[0] if found else None


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"{param}: not valid JSON: {exc}", param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be a JSON schema object", param=param)
    return value


def _spec(param: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidRequest as exc:
        raise APIError(400, f"{param}: {str(exc).split(': ', 1)[-1]}", param=param) from None


async def constraint(settings: Settings, info: ModelInfo, req: SamplingBody,
                     plan: ToolPlan | None = None) -> StructuredOutputsParams | None:
    """The request's constraint, checked and compiled (see the module's docstring)."""
    asked = requested(req)
    if plan is not None:
        for i, tool in enumerate(plan.tools):
            param = f"tools[{i}].function.parameters"
            await check(settings, info, _spec(param, json=parameters_of(tool)), param)
        if plan.forced:
            if asked is not None:
                raise APIError(400, f"{asked[1]}: cannot be combined with tool_choice {plan.choice!r}",
                               param=asked[1])
            asked = (_spec("tools", json=plan.schema()), "tools")
    if asked is None:
        return None
    spec, param = asked
    await check(settings, info, spec, param)
    return spec


async def check(settings: Settings, info: ModelInfo, spec: StructuredOutputsParams, param: str) -> None:
    """400 naming `param` when the spec is too large, does not compile, or compiles too slowly."""
    _, text = spec.key()
    limit = settings.max_schema_bytes
    if len(text.encode()) > limit:
        raise APIError(400, f"{param}: larger than {limit} bytes", param=param, code="schema_too_large")
    compiler = grammar_compiler(info.path, info.config.vocab_size, info.config.eos_token_ids)
    timeout = settings.grammar_compile_timeout_s
    try:    # shielded: the compile goes on (and is cached) when this wait gives up
        future = compiler.compile(spec, grammar_owner.get())
        compiled = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
    except TimeoutError:
        compiled = None
    except GrammarError as exc:
        detail = str(exc).removeprefix(f"{exc.field}: ")
        code = "schema_too_complex" if isinstance(exc, GrammarTooComplex) else "invalid_schema"
        raise APIError(400, f"{param}: {detail}", param=param, code=code) from None
    except Exception as exc:  # noqa: BLE001 - the grammar library's own failure on this input
        raise APIError(400, f"{param}: could not be compiled ({type(exc).__name__}: {exc})", param=param,
                       code="invalid_schema") from None
    if compiled is None or compiled.seconds > timeout:
        raise APIError(400, f"{param}: took longer than {timeout:g} s to compile", param=param,
                       code="schema_too_complex")
