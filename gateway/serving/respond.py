"""A job run to its answer: admitted, submitted, then one JSON body or an SSE stream, with a
client's disconnect aborting the run (499) and every ending writing exactly one usage row."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lockgate.gateway import structured
from lockgate.gateway.errors import APIError
from lockgate.gateway.protocol import SamplingBody, read_json
from lockgate.gateway.responses import Head, Kind, answer, sse, usage_chunk
from lockgate.gateway.serving.job import Job, JobMaker
from lockgate.gateway.serving.prepare import prepare
from lockgate.gateway.serving.run import RequestRun
from lockgate.gateway.serving.ticket import admitted, ratelimit_headers
from lockgate.gateway.serving.tiers import usage_status
from lockgate.gateway.state import AppState
from lockgate.tenancy.auth import Principal

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=SamplingBody)


def check_draining(state: AppState) -> None:
    if state.draining:
        raise APIError(503, "The server is shutting down; retry on another replica.",
                       code="server_draining", headers={"retry-after": "5"})


async def serve_inference(request: Request, state: AppState, principal: Principal, body: type[R],
                          unsupported: tuple[str, ...], make_job: JobMaker) -> Response:
    """An inference route's whole work: admitted (rate and concurrency, before the body is
    read), the body parsed and checked, its job built, run and answered."""
    check_draining(state)
    structured.grammar_owner.set(principal.tenant_id or "default")   # this request's task only
    async with admitted(state, principal, request) as ticket:
        req, entry, tier = await prepare(state.models, state.settings, principal, await read_json(request),
                                         body, unsupported)
        job = await make_job(state.settings, state.tokenize, req, entry)
        return await respond(request, RequestRun(ticket, entry, tier, job.inputs), job, req, tier)


async def respond(request: Request, run: RequestRun, job: Job, req: SamplingBody, tier: str) -> Response:
    """Admit and submit `run`, then answer: an SSE stream, or one JSON body built from the
    finished outputs (or the refusal, if the engine shed the run from its queue first)."""
    run.client_request_id = request.state.request_id     # set by RequestContext, echoed back
    await run.admit()
    try:
        # a stream's 200 goes out at once, so the engine may not shed it later; a JSON answer
        # waits for the end, so a shed before then is still answered as a refusal
        await run.submit(sheddable=not req.stream)
        headers = {**ratelimit_headers(run.decision)} if run.decision else {}
        h = job.head(run, req.model, tier)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            run.continuous_usage = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            return StreamingResponse(sse_stream(run, job.kind, h, job.chunks(run, h, include_usage), include_usage),
                                     media_type="text/event-stream", headers=headers)
    except BaseException as exc:   # anything unforeseen once the run holds the admission: it ends
        with contextlib.suppress(APIError):
            await asyncio.shield(run.finish(usage_status(exc)))   # a no-op after refuse/finish
        raise

    return await answer_whole(request, run, lambda: answer(job.kind, h, job.choices(run.finals), run.usage),
                              headers)


async def answer_whole(request: Request, run: RequestRun, body: Callable[[], dict[str, Any]],
                       headers: dict[str, str]) -> Response:
    """The JSON answer of a submitted run: its end awaited (a client that leaves aborts it),
    ``body`` built while its usage row is committed; any failure ends the run with one row by
    the usage rule (a no-op after `refuse` or `finish`)."""
    async def collect() -> JSONResponse:
        async for _ in run.events():
            pass
        built: list[dict[str, Any]] = []
        await run.finish("ok", lambda: built.append(body()))
        return JSONResponse(built[0], headers=headers)

    try:
        return await run_or_disconnect(request, run, collect())
    except Exception as exc:
        with contextlib.suppress(APIError):
            await asyncio.shield(run.finish(usage_status(exc)))
        raise


async def wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_or_disconnect(request: Request, run: RequestRun, coro: Awaitable[Response]) -> Response:
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


async def sse_stream(run: RequestRun, kind: Kind, h: Head, chunks: AsyncIterator[bytes],
                     include_usage: bool) -> AsyncIterator[bytes]:
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
            yield sse(usage_chunk(kind, h, usage))
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
