"""A Responses API request (`POST /v1/responses`) run through the chat path: its input items
(and the stored conversation its `previous_response_id` continues) become a chat completion
request, which takes the chat path's every step (`prepare`: model, tier, limits; `chat_job`:
template, tools, tokens, grammar; `RequestRun`: admission, engine, exactly one usage row),
and the run's text becomes Response output items (`OutputWriter`), whole or streamed as
OpenAI's events.

The fields map one to one: `instructions` -> a system message first (a previous response's
are not carried over, as OpenAI's are not); `message` items -> messages; consecutive
`function_call` items -> one assistant message's `tool_calls`; `function_call_output` ->
a `tool` message (its `call_id` must answer a call before it); `tools` and `tool_choice`;
`text.format` -> `response_format` (a json_schema through the grammar path);
`max_output_tokens` -> `max_completion_tokens`; `temperature`, `top_p`, `service_tier`,
`user`, Lockgate's `speculative`. An error the chat path raises names the Responses field (`responses_fields`).

`store` (the default): once the usage row is committed, the Response object and the
request's input items are kept in the database (`tenancy.stored_responses`), before the
client sees the answer (the JSON body, or `response.completed`), so that a
`previous_response_id` naming it works at once, on every replica. A response that cannot be
stored answers 503 (`response.failed` in a stream); its usage row stands (the work ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lockgate.gateway import structured
from lockgate.gateway.errors import APIError, database_unavailable, is_database_down
from lockgate.gateway.protocol import ChatCompletionRequest, read_json
from lockgate.gateway.responses_objects import OutputWriter, event, new_item_id, response_head, response_object
from lockgate.gateway.responses_protocol import (
    FunctionCallItem,
    FunctionChoice,
    Item,
    MessageItem,
    ResponsesRequest,
    parse_request,
)
from lockgate.gateway.serving.chat import chat_job
from lockgate.gateway.serving.prepare import prepare
from lockgate.gateway.serving.respond import check_draining, run_or_disconnect
from lockgate.gateway.serving.run import RequestRun
from lockgate.gateway.serving.ticket import admitted, ratelimit_headers
from lockgate.gateway.serving.tiers import usage_status
from lockgate.gateway.state import AppState
from lockgate.gateway.tool_calls import ToolPlan, tool_plan
from lockgate.tenancy import stored_responses
from lockgate.tenancy.auth import Principal
from lockgate.tenancy.errors import NotFound

logger = logging.getLogger(__name__)

# the chat path's field names -> the Responses API's
_RENAMES = ((re.compile(r"^messages\b.*"), "input"),
            (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
            (re.compile(r"^response_format\.json_schema\.schema$"), "text.format.schema"),
            (re.compile(r"^response_format(\.json_schema)?(?=\.|$)"), "text.format"),
            (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
            (re.compile(r"^tool_choice\.function\."), "tool_choice."))


def responses_param(param: str) -> str:
    for pattern, repl in _RENAMES:
        param = pattern.sub(repl, param, count=1)
    return param


@contextlib.contextmanager
def responses_fields() -> Iterator[None]:
    """An APIError of the chat path names the Responses field instead (message and param)."""
    try:
        yield
    except APIError as exc:
        if exc.param:
            new = responses_param(exc.param)
            exc.message = exc.message.replace(exc.param, new)
            exc.args = (exc.message,)
            exc.param = new
        raise


# -- the request as a chat completion ---------------------------------------------------------------
def stored_item(item: Item) -> dict[str, Any]:
    """An input item as it is stored and listed: an id, a type and a status each; a message's
    text as content parts."""
    if isinstance(item, MessageItem):
        kind = "output_text" if item.role == "assistant" else "input_text"
        content = ([{"type": kind, "text": item.content}] if isinstance(item.content, str)
                   else [p.model_dump(exclude_none=True, exclude={"parsed"}) for p in item.content])
        return {"id": item.id or new_item_id("msg"), "type": "message", "role": item.role, "content": content,
                "status": item.status or "completed"}
    if isinstance(item, FunctionCallItem):
        return {"id": item.id or new_item_id("fc"), "type": "function_call", "call_id": item.call_id,
                "name": item.name, "arguments": item.arguments, "status": item.status or "completed"}
    return {"id": item.id or new_item_id("fco"), "type": "function_call_output", "call_id": item.call_id,
            "output": item.text(), "status": item.status or "completed"}


def _text(content: list[dict[str, Any]]) -> str:
    return "".join(p.get("text") or p.get("refusal") or "" for p in content)


def chat_messages(instructions: str | None, history: list[dict[str, Any]],
                  items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: the instructions, the stored conversation, then
    this request's items (see the module's docstring)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    for n, item in enumerate([*history, *items]):
        kind = item.get("type")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item.get("content") or [])})
        elif kind == "function_call":
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            i = n - len(history)
            if i >= 0 and item["call_id"] not in calls:
                raise APIError(400, f"input[{i}].call_id: no function_call with call_id {item['call_id']!r} "
                               "comes before this output", param=f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completion request the Responses request means."""
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": bool(req.stream)}
    optional = {"max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "service_tier": req.service_tier, "user": req.user,
                "parallel_tool_calls": req.parallel_tool_calls, "prompt_cache_key": req.prompt_cache_key,
                "speculative": req.speculative}
    body.update({k: v for k, v in optional.items() if v is not None})
    tools = req.function_tools()
    if tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, FunctionChoice) else choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {k: v for k, v in schema.items() if v is not None}}
    return body


# -- storage -----------------------------------------------------------------------------------------
async def previous_items(state: AppState, tenant_id: str, response_id: str | None) -> list[dict[str, Any]]:
    """The stored conversation `response_id` ends; 404 when the tenant has no such response."""
    if response_id is None:
        return []
    try:
        async with state.sessions() as session:
            return await stored_responses.conversation(session, response_id=response_id, tenant_id=tenant_id)
    except NotFound:
        raise APIError(404, f"Previous response with id {response_id!r} not found.",
                       param="previous_response_id", code="previous_response_not_found") from None
    except Exception as exc:
        if is_database_down(exc):
            raise database_unavailable() from None
        raise


@dataclass(slots=True)
class Answer:
    """What a run's answer is built and kept with."""

    state: AppState
    tenant_id: str
    req: ResponsesRequest
    items: list[dict[str, Any]]       # the request's input items, as stored
    plan: ToolPlan | None             # the tools and how the answer may use them

    async def keep(self, body: dict[str, Any]) -> None:
        """Store the response (`store`, the default); 503 when the database does not take it."""
        if self.req.store is False:
            return
        try:
            async with self.state.sessions() as session:
                await stored_responses.store_response(session, tenant_id=self.tenant_id, response=body,
                                                      input_items=self.items,
                                                      retention_s=self.state.settings.responses_retention_s)
        except Exception as exc:
            logger.error("response %s not stored: %r", body["id"], exc)
            if is_database_down(exc):
                raise database_unavailable() from None
            raise


def final_status(writer: OutputWriter) -> str:
    return "incomplete" if writer.incomplete else "completed"


# -- the route's work ----------------------------------------------------------------------------------
async def serve_responses(request: Request, state: AppState, principal: Principal) -> Response:
    """`POST /v1/responses`: admitted before the body is read (as chat), the body checked,
    the conversation read back, then the chat path's preparation, run and one usage row."""
    check_draining(state)
    structured.grammar_owner.set(principal.tenant_id or "default")
    tenant_id = principal.tenant_id or ""
    async with admitted(state, principal, request) as ticket:
        req, items = parse_request(await read_json(request))
        stored = [stored_item(item) for item in items]
        history = await previous_items(state, tenant_id, req.previous_response_id)
        body = chat_body(req, chat_messages(req.instructions, history, stored))
        with responses_fields():
            chat_req, entry, tier = await prepare(state.models, state.settings, principal, body,
                                                  ChatCompletionRequest, ())
            job = await chat_job(state.settings, state.tokenize, chat_req, entry)
        plan = tool_plan(chat_req.tools, chat_req.tool_choice, chat_req.parallel_tool_calls)
        answer = Answer(state, tenant_id, req, stored, plan)
        return await respond(request, RequestRun(ticket, entry, tier, job.inputs), answer, tier)


async def respond(request: Request, run: RequestRun, answer: Answer, tier: str) -> Response:
    """Admit and submit `run`, then answer with the Response object or its event stream
    (serving/respond.py's `respond`, in the Responses API's shapes)."""
    run.client_request_id = request.state.request_id
    await run.admit()
    stream = bool(answer.req.stream)
    try:
        await run.submit(sheddable=not stream)
        headers = ratelimit_headers(run.decision) if run.decision else {}
        head = response_head(answer.req, f"resp_{run.id}", run.t0, tier)
        if stream:
            return StreamingResponse(events(run, answer, head), media_type="text/event-stream", headers=headers)
    except BaseException as exc:   # anything once the run holds the admission: it ends
        with contextlib.suppress(APIError):
            await asyncio.shield(run.finish(usage_status(exc)))
        raise

    async def collect() -> JSONResponse:
        async for _ in run.events():
            pass
        writer = OutputWriter(answer.plan)
        writer.start()
        final = run.finals.get(0)
        if final is not None and final.outputs:
            writer.feed(final.outputs[0].text)
            writer.close(final.outputs[0].finish_reason)
        built: list[dict[str, Any]] = []

        def build() -> None:        # while the usage row is being committed
            built.append(response_object(head, final_status(writer), writer.items, run.usage))

        await run.finish("ok", build)
        await answer.keep(built[0])
        return JSONResponse(built[0], headers=headers)

    try:
        return await run_or_disconnect(request, run, collect())
    except Exception as exc:    # one row by the usage rule (a no-op after `refuse` or `finish`)
        with contextlib.suppress(APIError):
            await asyncio.shield(run.finish(usage_status(exc)))
        raise


async def events(run: RequestRun, answer: Answer, head: dict[str, Any]) -> AsyncIterator[bytes]:
    """The event stream (responses_objects.py): the output as it is written; then the usage
    row committed and the response stored, then `response.completed`. A failure after the
    headers went out, or a cut, is `response.failed` with its error; any ending but success
    (a disconnect included) still finishes the run, shielded, with the tokens sent so far."""
    seq = itertools.count()
    writer = OutputWriter(answer.plan)
    status = "cancelled"
    try:
        for kind in ("response.created", "response.in_progress"):
            yield event(kind, next(seq), response=response_object(head, "in_progress", []))
        finish_reason = None
        for kind, fields in writer.start():
            yield event(kind, next(seq), **fields)
        async for _, out in run.events():
            c = out.outputs[0]
            finish_reason = c.finish_reason or finish_reason
            sent = writer.feed(c.delta_text)
            for kind, fields in sent:
                yield event(kind, next(seq), **fields)
            if sent:
                run.mark_sent(0, 0, len(c.token_ids))
        for kind, fields in writer.close(finish_reason):
            yield event(kind, next(seq), **fields)
        usage = await run.finish("ok")
        status = "ok"
        body = response_object(head, final_status(writer), writer.items, usage)
        await answer.keep(body)
        yield event(f"response.{body['status']}", next(seq), response=body)
    except APIError as exc:
        status = status if status == "ok" else usage_status(exc)
        yield _failed(head, writer, run, next(seq), exc.code or exc.type, exc.message)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # any failure, logged: the headers are gone; say it in the stream
        status = status if status == "ok" else "error"
        logger.exception("response stream of %s failed", run.id)
        yield _failed(head, writer, run, next(seq), "server_error", f"The stream failed: {type(exc).__name__}")
    finally:
        if status != "ok":
            with anyio.CancelScope(shield=True), contextlib.suppress(APIError):
                await run.finish(status)


def _failed(head: dict[str, Any], writer: OutputWriter, run: RequestRun, seq: int, code: str,
            message: str) -> bytes:
    body = response_object(head, "failed", writer.items, run.usage, error={"code": code, "message": message})
    return event("response.failed", seq, response=body)
