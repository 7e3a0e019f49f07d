"""Anthropic's Messages API through the serving layer: a message is the chat completion it
asks for (gateway/anthropic_protocol.py `chat_body`), admitted, built (`chat_job`: template,
tools, tokens, grammar), run and billed exactly as chat is (the same `Ticket`, `RequestRun`,
tiers, quotas and one usage row), and answered in Anthropic's shapes
(gateway/anthropic_responses.py).

A model name is first looked up among the model aliases (`served_name`): the tenant's own
(`tenants.model_aliases`), then the server's (`Settings.model_aliases`), each a name or an
`fnmatch` pattern (`claude-*`, as Claude Code and the `anthropic` client send ids) -> a served
model; exact names before patterns, longer patterns before shorter. An unaliased name is
used as it is; one that is not served is a 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lockgate.gateway import structured
from lockgate.gateway.anthropic_errors import sse_error
from lockgate.gateway.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_body,
    chat_messages,
    chat_tools,
    refuse_unsupported,
)
from lockgate.gateway.anthropic_responses import MessageEvents, message_body
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_directory import ModelEntry
from lockgate.gateway.protocol import ChatCompletionRequest, parse, read_json
from lockgate.gateway.serving.chat import chat_job
from lockgate.gateway.serving.prepare import resolve_model, resolve_tier, tokenizer_error
from lockgate.gateway.serving.respond import answer_whole, check_draining
from lockgate.gateway.serving.run import RequestRun
from lockgate.gateway.serving.ticket import admitted, ratelimit_headers
from lockgate.gateway.serving.tiers import usage_status
from lockgate.gateway.state import AppState
from lockgate.gateway.tokenize_pool import TokenizerError
from lockgate.gateway.tool_calls import ToolPlan, prompt_messages, tool_plan
from lockgate.tenancy.auth import Principal

logger = logging.getLogger(__name__)


def alias_of(name: str, aliases: Iterable[tuple[str, str]]) -> str | None:
    """The served model `aliases` map `name` to: an exact name first, then the longest
    matching pattern; None when none does."""
    table = dict(aliases)
    if name in table:
        return table[name]
    patterns = sorted((p for p in table if any(ch in p for ch in "*?[")), key=len, reverse=True)
    return next((table[p] for p in patterns if fnmatch.fnmatchcase(name, p)), None)


def served_name(state: AppState, principal: Principal, name: str) -> str:
    return (alias_of(name, principal.model_aliases)
            or alias_of(name, state.settings.model_aliases.items()) or name)


async def resolve_entry(state: AppState, principal: Principal, name: str) -> ModelEntry:
    """The served model (or adapter) `name` stands for; a 404 naming what was asked."""
    target = served_name(state, principal, name)
    try:
        entry = await resolve_model(state.models, principal, target)
    except APIError as exc:
        if target != name and exc.status == 404:
            raise APIError(404, f"The model `{name}` (an alias of `{target}`) does not exist or you do not "
                           "have access to it.", param="model", code="model_not_found") from None
        raise
    if entry.parent is not None:
        await state.models.use_adapter(entry)
    return entry


def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, body)


async def serve_messages(request: Request, state: AppState, principal: Principal) -> Response:
    """`POST /v1/messages`: admitted (rate and concurrency, before the body is read), parsed,
    built as chat's job, run and answered as a message or its event stream."""
    check_draining(state)
    structured.grammar_owner.set(principal.tenant_id or "default")   # this request's task only
    async with admitted(state, principal, request) as ticket:
        data = await read_json(request)
        refuse_unsupported(data)
        req = parse(MessagesRequest, data)
        if len(req.stop_sequences or []) > state.settings.max_stop_sequences:
            raise APIError(400, f"stop_sequences: at most {state.settings.max_stop_sequences}",
                           param="stop_sequences")
        entry = await resolve_entry(state, principal, req.model)
        tier = resolve_tier(principal, None)
        chat = chat_request(chat_body(req, entry.name))
        job = await chat_job(state.settings, state.tokenize, chat, entry)
        plan = tool_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        run = RequestRun(ticket, entry, tier, job.inputs)
        return await respond_message(request, run, req, plan)


async def respond_message(request: Request, run: RequestRun, req: MessagesRequest,
                          plan: ToolPlan | None) -> Response:
    """Admit and submit `run`, then answer: the event stream, or the message built from the
    finished output (serving/respond.py's `respond`, in Anthropic's shapes)."""
    run.client_request_id = request.state.request_id
    stops = req.stop_sequences or []
    await run.admit()
    try:
        await run.submit(sheddable=not req.stream)
        headers = {**ratelimit_headers(run.decision)} if run.decision else {}
        if req.stream:
            events = MessageEvents(run.id, req.model, len(run.prompts[0]), plan, stops)
            return StreamingResponse(message_stream(run, events), media_type="text/event-stream", headers=headers)
    except BaseException as exc:   # anything unforeseen once the run holds the admission: it ends
        with contextlib.suppress(APIError):
            await asyncio.shield(run.finish(usage_status(exc)))
        raise

    def body() -> dict[str, Any]:        # while the usage row is being committed
        if run.usage is None:
            raise RuntimeError(f"run {run.id} finished without its usage")
        return message_body(run.id, req.model, run.finals[0].outputs[0], run.usage, run.tier, plan, stops)

    return await answer_whole(request, run, body, headers)


async def message_stream(run: RequestRun, events: MessageEvents) -> AsyncIterator[bytes]:
    """The event stream: each output's events as it comes; then the usage row committed and
    the lease settled (`run.finish`), then `message_delta` (stop reason, usage) and
    `message_stop`. A failure once the 200 went out is one `error` event; any ending but
    success (a disconnect included) still finishes the run, shielded (serving/respond.py's
    `sse_stream`, in Anthropic's events)."""
    status = "cancelled"
    try:
        async for _, out in run.events():
            c = out.outputs[0]
            for data in events.feed(c, out.num_cached_tokens):
                yield data
            run.mark_sent(0, c.index, len(c.token_ids))
        usage = await run.finish("ok")
        status = "ok"
        final = run.finals[0].outputs[0] if run.finals else None
        for data in events.end(final, usage):
            yield data
    except APIError as exc:
        status = usage_status(exc)
        yield sse_error(exc)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # any failure, logged: the headers are gone; say it in the stream
        status = "error"
        logger.exception("message stream of %s failed", run.id)
        yield sse_error(APIError(500, f"The stream failed: {type(exc).__name__}", code="internal_error"))
    finally:
        if status != "ok":
            with anyio.CancelScope(shield=True), contextlib.suppress(APIError):
                await run.finish(status)


async def count_tokens(request: Request, state: AppState, principal: Principal) -> dict[str, int]:
    """`POST /v1/messages/count_tokens`: the tokens the message's prompt would be, tools
    included, as `/v1/messages` would send the engine; not billed, counted against the
    request rate and concurrency as any request (as vLLM's `/tokenize`)."""
    async with admitted(state, principal, request) as ticket:
        data = await read_json(request)
        refuse_unsupported(data)
        req = parse(CountTokensRequest, data)
        entry = await resolve_entry(state, principal, req.model)
        chat = chat_request({"model": entry.name, "messages": chat_messages(req), **chat_tools(req)})
        plan = tool_plan(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        info = entry.info
        messages, tools = prompt_messages(chat.messages, plan, info.tokenizer.template_renders_tools)
        limit = state.settings.max_prompt_chars
        if sum(len(m["content"]) for m in messages) > limit:
            raise APIError(400, f"messages: longer than {limit} characters", param="messages")
        try:
            ids = await state.tokenize.chat_prompt_ids(info, messages, tools, bound=False)   # any length
        except TokenizerError as exc:
            raise tokenizer_error(exc) from None
        except Exception as exc:  # noqa: BLE001 - a template's own error is the client's input
            raise APIError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
        if ticket.deferred:
            await ticket.count()        # against the request rate, as any request
        return {"input_tokens": len(ids)}
