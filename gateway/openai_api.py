"""The OpenAI-compatible routes: chat completions, completions, models, a tenant's usage."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from lockgate.engine import InvalidRequest, SamplingParams, StructuredOutputsParams
from lockgate.gateway import structured
from lockgate.gateway.admission import Ticket, admitted, ratelimit_headers
from lockgate.gateway.deps import StateDep, TenantDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.jobs import RequestRun, usage_status
from lockgate.gateway.openapi import error_responses, json_body
from lockgate.gateway.output_shapes import chat_logprobs, completion_logprobs, sse
from lockgate.gateway.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    parse,
    read_json,
    refuse_unsupported,
)
from lockgate.gateway.quota_report import TENANT_QUERY, QuotaReportPublic, quota_response
from lockgate.gateway.state import AppState, ModelEntry
from lockgate.gateway.tokenize_pool import TokenizerBusy, TokenizerError
from lockgate.gateway.tool_calls import ToolCallReader, ToolPlan, chat_message, prompt_messages, tool_plan
from lockgate.gateway.usage_api import usage_response
from lockgate.tenancy.auth import Principal

logger = logging.getLogger(__name__)
router = APIRouter()
BODY_MODELS = (ChatCompletionRequest, CompletionRequest)   # read by the routes, shown in the schema
_INFERENCE_ERRORS = error_responses(400, 401, 403, 404, 413, 415, 429, 503)


# -- resolving ---------------------------------------------------------------------------------
async def resolve_model(state: AppState, principal: Principal, name: str) -> ModelEntry:
    """A served model or adapter the tenant may use (404 otherwise: another tenant's
    adapter is indistinguishable from none)."""
    entry = await state.find_model(principal, name)
    if entry is None:
        raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                       param="model", code="model_not_found")
    return entry


def resolve_tier(principal: Principal, requested: str | None) -> str:
    tier = principal.default_tier if requested in (None, "auto") else requested
    if tier not in principal.service_tiers:
        raise APIError(403, f"service_tier {tier!r} is not in this tenant's plan "
                       f"(allowed: {', '.join(principal.service_tiers)})",
                       param="service_tier", code="service_tier_not_allowed")
    return tier


def check_common(state: AppState, req: Any) -> None:
    s = state.settings
    if (req.n or 1) > s.max_n:
        raise APIError(400, f"n: at most {s.max_n} choices per request", param="n")
    if len(req.stop_list()) > s.max_stop_sequences:
        raise APIError(400, f"stop: at most {s.max_stop_sequences} stop sequences", param="stop")


def sampling(req: Any, max_tokens: int, logprobs: int | None,
             structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    kw: dict[str, Any] = {
        "n": req.n or 1, "max_tokens": max_tokens, "logprobs": logprobs,
        "stop": req.stop_list() or None, "seed": req.seed, "structured_outputs": structured_outputs,
    }
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                 "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                 "skip_special_tokens", "include_stop_str_in_output"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if kw.get("min_tokens", 0) > max_tokens:
        raise APIError(400, f"min_tokens ({kw['min_tokens']}) exceeds max_tokens ({max_tokens})",
                       param="min_tokens")
    try:
        return SamplingParams(**kw)
    except InvalidRequest as exc:
        raise APIError(400, str(exc), param=exc.field) from None


def max_tokens_for(state: AppState, entry: ModelEntry, prompt_len: int, requested: int | None,
                   param: str, prompt_param: str) -> int:
    max_len = entry.info.max_model_len
    cap = state.settings.max_tokens_limit
    if requested is not None and cap is not None and requested > cap:
        raise APIError(400, f"{param}: at most {cap} on this server", param=param)
    if requested is None:
        left = max_len - prompt_len
        if left < 1:
            raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, "
                           f"your {prompt_param} resulted in {prompt_len} tokens. Please reduce the "
                           f"length of the {prompt_param}.", param=prompt_param,
                           code="context_length_exceeded")
        return min(left, cap) if cap is not None else left
    if prompt_len + requested > max_len:
        raise APIError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                       f"requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
                       f"{requested} in the completion). Please reduce the length of the "
                       f"{prompt_param} or completion.", param=prompt_param,
                       code="context_length_exceeded")
    return requested


def tokenizer_error(exc: TokenizerError) -> APIError:
    """The tokenizer's worker pool is full (`tokenizer_busy`) or failed: a 503 to retry."""
    busy = isinstance(exc, TokenizerBusy)
    retry = exc.retry_after_s if isinstance(exc, TokenizerBusy) else 1
    return APIError(503, f"The prompt could not be tokenized now: {exc}. Retry shortly.",
                    code="tokenizer_busy" if busy else "tokenizer_unavailable",
                    headers={"retry-after": str(retry)})


def check_draining(state: AppState) -> None:
    if state.draining:
        raise APIError(503, "The server is shutting down; retry on another replica.",
                       code="server_draining", headers={"retry-after": "5"})


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_or_disconnect(request: Request, run: RequestRun, coro) -> Any:
    """Run `coro` in this task; if the client goes away first, abort the run (engine
    requests, lease) and answer 499. A watcher task reads the connection and cancels this
    task on a disconnect (one task a request, not two and an `asyncio.wait`)."""
    task = asyncio.current_task()
    if task is None:
        raise RuntimeError("run_or_disconnect runs inside the request's task")
    state = {"active": True, "gone": False}

    def on_watcher_done(w: asyncio.Future) -> None:
        if state["active"] and not w.cancelled() and w.exception() is None:
            state["gone"] = True
            task.cancel()

    watcher = asyncio.ensure_future(wait_disconnect(request))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await coro
    except asyncio.CancelledError:
        if not state["gone"]:           # cancelled from outside (shutdown): finish, pass it on
            await asyncio.shield(run.finish("cancelled"))
            raise
        task.uncancel()
    finally:
        state["active"] = False
        watcher.cancel()
    await run.finish("cancelled")
    raise APIError(499, "client closed the request", code="client_closed_request")


async def open_request(request: Request, state: AppState, principal: Principal, model: type[BaseModel],
                       unsupported: tuple[str, ...]) -> tuple[Any, ModelEntry, str]:
    """What both inference routes do once admitted (`admitted`): body, model, tier, limits."""
    return await open_body(state, principal, await read_json(request), model, unsupported)


async def open_body(state: AppState, principal: Principal, data: Any, model: type[BaseModel],
                    unsupported: tuple[str, ...], tier: str | None = None) -> tuple[Any, ModelEntry, str]:
    """A request's parsed body, its model (an adapter in use) and its tier (`tier`, when the
    caller fixes it, as a batch does: still checked against the plan); APIError otherwise."""
    refuse_unsupported(data, unsupported)
    req = parse(model, data)
    entry = await resolve_model(state, principal, req.model)
    tier = resolve_tier(principal, tier or req.service_tier)
    check_common(state, req)
    if entry.parent is not None:
        await state.use_adapter(entry)
    return req, entry, tier


async def respond(request: Request, run: RequestRun, req: Any, tier: str, id_prefix: str, obj: str,
                  stream, choices) -> Response:
    """Admit and submit `run`, then answer: an SSE stream (`stream(run, base, include_usage)`)
    or one JSON body whose choices `choices()` builds from the finished outputs (or the
    refusal, if the engine shed the run from its queue first)."""
    run.client_request_id = request.state.request_id     # set by RequestContext, echoed back
    await run.admit()
    try:
        # a stream's 200 goes out at once, so the engine may not shed it later; a JSON answer
        # waits for the end, so a shed before then is still answered as a refusal
        await run.submit(sheddable=not req.stream)
        headers = {**ratelimit_headers(run.decision)} if run.decision else {}
        base = {"id": f"{id_prefix}-{run.id}", "created": int(run.t0), "model": req.model,
                "service_tier": tier, "system_fingerprint": None}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            run.continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return StreamingResponse(stream(run, base, include_usage), media_type="text/event-stream",
                                     headers=headers)
    except BaseException as exc:   # anything unforeseen once the run holds the admission: it ends
        with contextlib.suppress(APIError):
            await asyncio.shield(run.finish(usage_status(exc)))   # a no-op after refuse/finish
        raise

    async def collect() -> JSONResponse:
        async for _ in run.events():
            pass
        built: list[JSONResponse] = []

        def build() -> None:        # while the usage row is being committed
            built.append(JSONResponse({**base, "object": obj, "choices": choices(),
                                       "usage": run.usage}, headers=headers))

        await run.finish("ok", build)
        return built[0]

    try:
        return await run_or_disconnect(request, run, collect())
    except Exception as exc:    # one row by the usage rule (a no-op after `refuse` or `finish`)
        with contextlib.suppress(APIError):
            await asyncio.shield(run.finish(usage_status(exc)))
        raise


# -- chat ------------------------------------------------------------------------------------------
@router.post("/v1/chat/completions", openapi_extra=json_body(ChatCompletionRequest), responses=_INFERENCE_ERRORS)
async def chat_completions(request: Request, principal: TenantDep, state: StateDep):
    check_draining(state)
    async with admitted(state, principal, request) as ticket:     # rate and concurrency, before the body
        return await chat_run(request, ticket)


@dataclass(slots=True)
class Job:
    """A parsed inference request ready to run: its `RequestRun`, how to build the JSON
    answer's choices once it finished, and how to stream it."""

    run: RequestRun
    choices: Callable[[], list[dict]]
    stream: Callable[[RequestRun, dict, bool], Any]
    id_prefix: str
    object: str

    def body(self, model: str, tier: str) -> dict:
        """The JSON answer of a finished run (its usage set by `finish`)."""
        run = self.run
        return {"id": f"{self.id_prefix}-{run.id}", "object": self.object, "created": int(run.t0),
                "model": model, "service_tier": tier, "system_fingerprint": None,
                "choices": self.choices(), "usage": run.usage}


async def chat_run(request: Request, ticket: Ticket) -> Response:
    state, principal = ticket.state, ticket.principal
    req, entry, tier = await open_request(request, state, principal, ChatCompletionRequest, UNSUPPORTED_CHAT)
    job = await chat_job(ticket, req, entry, tier)
    return await respond(request, job.run, req, tier, job.id_prefix, job.object, job.stream, job.choices)


async def chat_job(ticket: Ticket, req: Any, entry: ModelEntry, tier: str) -> Job:
    state = ticket.state
    info = entry.info
    plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    messages, tools = prompt_messages(req.messages, plan, info.tokenizer.template_renders_tools)
    if sum(len(m["content"]) for m in messages) > state.settings.max_prompt_chars:
        raise APIError(400, f"messages: longer than {state.settings.max_prompt_chars} characters",
                       param="messages")
    try:    # off the event loop when large; special tokens in the messages tokenized as text
        ids = await state.tokenize.chat_prompt_ids(info, messages, tools)
    except TokenizerError as exc:
        raise tokenizer_error(exc) from None
    except Exception as exc:  # noqa: BLE001 - a template's own error is the client's input
        raise APIError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
    max_tokens = max_tokens_for(state, entry, len(ids), req.requested_max_tokens(),
                                "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
                                "messages")
    top = req.top_logprobs or 0
    spec = await structured.constraint(state.settings, info, req, plan)
    params = sampling(req, max_tokens, top if req.logprobs else None, spec)
    run = RequestRun(ticket, entry, tier, [ids], [params], len(ids) + max_tokens * params.n,
                     req.cache_salt, priority=req.priority or 0)

    def choices() -> list[dict]:
        out = []
        for c in run.finals[0].outputs:
            message, finish_reason = chat_message(c.text, c.finish_reason, plan)
            out.append({"index": c.index, "message": message, "logprobs": chat_logprobs(c, 0, top),
                        "finish_reason": finish_reason})
        return out

    return Job(run, choices, lambda j, base, usage: chat_stream(j, base, top, usage, params.n, plan),
               "chatcmpl", "chat.completion")


async def sse_stream(run: RequestRun, chunks, chunk: dict, include_usage: bool):
    """The SSE body around `chunks` (the choices' chunks as they come): then the usage row
    is committed and the lease settled (`run.finish`), then the usage chunk and
    `data: [DONE]`. A failure after the headers went out, or a cut (shutdown,
    `request_timeout_s`), is reported in the stream as one `data: {"error": ...}` event and
    the stream closes; any ending but success (a disconnect included) still finishes the
    run, shielded, with the tokens sent so far."""
    status = "cancelled"
    try:
        async for data in chunks:
            yield data
        usage = await run.finish("ok")
        status = "ok"
        if include_usage:
            yield sse({**chunk, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"
    except APIError as exc:
        status = usage_status(exc)
        yield sse(exc.body())
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # any failure, logged: the headers are gone; say it in the stream
        status = "error"
        logger.exception("stream of %s failed", run.id)
        yield sse(APIError(500, f"The stream failed: {type(exc).__name__}", code="internal_error").body())
    finally:
        if status != "ok":
            with anyio.CancelScope(shield=True), contextlib.suppress(APIError):
                await run.finish(status)


def chunk_usage(run: RequestRun, include_usage: bool) -> dict:
    """A chunk's usage: none; null (`include_usage`: the usage comes in a chunk of its own
    at the end); or, with vLLM's `continuous_usage_stats`, the usage so far."""
    if not include_usage:
        return {}
    return {"usage": run.usage_dict() if run.continuous_usage else None}


def chat_stream(run: RequestRun, base: dict, top: int, include_usage: bool, n: int, plan: ToolPlan | None = None):
    """Content deltas; or, when the answer is forced to be tool calls, `delta.tool_calls`
    (each call's id and name, then pieces of its arguments) and finish_reason "tool_calls"."""
    chunk = {**base, "object": "chat.completion.chunk"}
    readers = [ToolCallReader() for _ in range(n)] if plan is not None and plan.forced else None

    async def chunks():
        sent_tokens = [0] * n
        for i in range(n):
            yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant",
                                                                   "content": None if readers else ""},
                                             "logprobs": None, "finish_reason": None}],
                       **chunk_usage(run, include_usage)})
        async for _, out in run.events():
            for c in out.outputs:
                if not (c.delta_text or c.finish_reason or (c.logprobs and len(c.token_ids) > sent_tokens[c.index])):
                    continue
                lp = chat_logprobs(c, sent_tokens[c.index], top)
                sent_tokens[c.index] = len(c.token_ids)
                delta, finish_reason = {"content": c.delta_text} if c.delta_text else {}, c.finish_reason
                if readers is not None:
                    calls = readers[c.index].feed(c.delta_text)
                    delta = {"tool_calls": calls} if calls else {}
                    if finish_reason == "stop" and readers[c.index].calls:
                        finish_reason = "tool_calls"
                    if not (calls or finish_reason or (lp and lp["content"])):
                        continue
                yield sse({**chunk, "choices": [{"index": c.index, "delta": delta, "logprobs": lp,
                                                 "finish_reason": finish_reason}],
                           **chunk_usage(run, include_usage)})
            run.mark_sent(0, out)

    return sse_stream(run, chunks(), chunk, include_usage)


# -- completions ----------------------------------------------------------------------------------
@router.post("/v1/completions", openapi_extra=json_body(CompletionRequest), responses=_INFERENCE_ERRORS)
async def completions(request: Request, principal: TenantDep, state: StateDep):
    check_draining(state)
    async with admitted(state, principal, request) as ticket:     # rate and concurrency, before the body
        return await completion_run(request, ticket)


async def completion_run(request: Request, ticket: Ticket) -> Response:
    state, principal = ticket.state, ticket.principal
    req, entry, tier = await open_request(request, state, principal, CompletionRequest, UNSUPPORTED_COMPLETION)
    job = await completion_job(ticket, req, entry, tier)
    return await respond(request, job.run, req, tier, job.id_prefix, job.object, job.stream, job.choices)


async def completion_job(ticket: Ticket, req: Any, entry: ModelEntry, tier: str) -> Job:
    state = ticket.state
    prompts = req.prompts()
    if not prompts:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if len(prompts) > 16:
        raise APIError(400, "prompt: at most 16 prompts per request", param="prompt")
    info = entry.info
    vocab = info.vocab_size
    ids_list: list[list[int]] = []
    for k, p in enumerate(prompts):
        if isinstance(p, str):
            if len(p) > state.settings.max_prompt_chars:
                raise APIError(400, f"prompt: longer than {state.settings.max_prompt_chars} characters",
                               param="prompt")
            try:        # one prompt at a time: a request never holds more than one worker
                ids = await state.tokenize.encode(info, p)
            except TokenizerError as exc:
                raise tokenizer_error(exc) from None
        else:
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in p):
                raise APIError(400, f"prompt[{k}]: token ids must be integers in [0, {vocab})",
                               param="prompt")
            ids = list(p)
        if not ids:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        ids_list.append(ids)
    params_list = []
    reserve = 0
    spec = await structured.constraint(state.settings, info, req)
    for ids in ids_list:
        mt = max_tokens_for(state, entry, len(ids), req.max_tokens, "max_tokens", "prompt")
        sp = sampling(req, mt, req.logprobs, spec)
        params_list.append(sp)
        reserve += len(ids) + mt * sp.n
    n = params_list[0].n
    top = req.logprobs or 0
    run = RequestRun(ticket, entry, tier, ids_list, params_list, reserve, req.cache_salt,
                     priority=req.priority or 0)

    def choices() -> list[dict]:
        return [{"index": i * n + c.index, "text": c.text,
                 "logprobs": completion_logprobs(c, 0, top, 0), "finish_reason": c.finish_reason}
                for i in range(len(ids_list)) for c in run.finals[i].outputs]

    return Job(run, choices, lambda j, base, usage: completion_stream(j, base, top, usage, n),
               "cmpl", "text_completion")


def completion_stream(run: RequestRun, base: dict, top: int, include_usage: bool, n: int):
    chunk = {**base, "object": "text_completion"}

    async def chunks():
        sent: dict[tuple[int, int], tuple[int, int]] = {}   # (prompt, choice) -> (tokens, chars)
        async for i, out in run.events():
            for c in out.outputs:
                toks, chars = sent.get((i, c.index), (0, 0))
                if not (c.delta_text or c.finish_reason or (c.logprobs and len(c.token_ids) > toks)):
                    continue
                lp = completion_logprobs(c, toks, top, chars)
                sent[(i, c.index)] = (len(c.token_ids), chars + len(c.delta_text))
                yield sse({**chunk, "choices": [{"index": i * n + c.index, "text": c.delta_text,
                                                 "logprobs": lp, "finish_reason": c.finish_reason}],
                           **chunk_usage(run, include_usage)})
            run.mark_sent(i, out)

    return sse_stream(run, chunks(), chunk, include_usage)


# -- models and usage --------------------------------------------------------------------------------
def model_card(m: ModelEntry) -> dict:
    """A model's card; an adapter's names its base model as `parent` and `root`."""
    return {"id": m.name, "object": "model", "created": m.created, "owned_by": "lockgate",
            "parent": m.parent, "root": m.parent or m.name, "max_model_len": m.info.max_model_len}


@router.get("/v1/models", responses=error_responses(401, 403))
async def list_models(principal: TenantDep, state: StateDep):
    entries = state.visible_models(principal) + await state.visible_adapters(principal)
    return {"object": "list", "data": [model_card(m) for m in entries]}


@router.get("/v1/models/{model_id:path}", responses=error_responses(401, 403, 404))
async def get_model(model_id: str, principal: TenantDep, state: StateDep):
    return model_card(await resolve_model(state, principal, model_id))


@router.get("/v1/usage", responses=error_responses(400, 401, 403))
async def tenant_usage(request: Request, principal: TenantDep, state: StateDep) -> Response:
    tenant_id = request.query_params.get("tenant_id")
    if tenant_id not in (None, "", principal.tenant_id):
        raise APIError(403, "A tenant's key reads only its own usage.", param="tenant_id",
                       code="permission_denied")
    return await usage_response(state, request, principal.tenant_id)


@router.get("/v1/usage/quota", responses=error_responses(400, 401, 403))
async def tenant_quota(request: Request, principal: TenantDep, state: StateDep) -> QuotaReportPublic:
    """The caller's tenant and its keys: each limit, its live use, and its refusals."""
    tenant_id = request.query_params.get("tenant_id")
    if principal.tenant_id is None or tenant_id not in (None, "", principal.tenant_id):
        raise APIError(403, "A tenant's key reads only its own quotas.", param="tenant_id",
                       code="permission_denied")
    return await quota_response(state, request, principal.tenant_id, allowed=TENANT_QUERY)

