"""`ProcessEngine`: an `AsyncEngine` in a process of its own behind the same `ModelEngine`
face, so that the server's HTTP loop (its parsing, its tokenizer workers, its GIL) never
slows the engine's step loop.

    engine = ProcessEngine(model=DIR)
    await engine.start()                 # spawns the child; its errors are raised here
    stream = engine.submit(ids, SamplingParams(max_tokens=8), "req-1")
    await stream.accepted()              # InvalidRequest, EngineOverloaded... as in-process

The hand-off is one pipe. Requests go to the child through a sender thread that sends, in one
message, whatever the event loop queued meanwhile (the loop never blocks on the pipe); the
child (engine/process_child.py) sends back one message per step with every output of that
step, and a stats snapshot at most every 50 ms. A reader thread here hands each message's
outputs to their streams' event loops in one callback. Adapter calls are RPCs bounded by
`call_timeout_s`. The child dying, whatever the cause: every open stream and every later
call gets EngineDead, `is_ready` turns false; nothing waits on it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.util  # its exit hook (joining children) registered before ours: ours runs first
import threading
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Unpack

from lockgate.engine.binding import ModelBinding
from lockgate.engine.client import (
    EngineAdmin,
    EngineClient,
    Prompt,
    RequestStream,
    SubmitOptions,
    checked_tenant_weight,
)
from lockgate.engine.config import EngineConfig
from lockgate.engine.errors import EngineDead, EngineError, InvalidRequest, UnknownModel
from lockgate.engine.lora import Adapter, LoRARequest
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.process_child import child_main, rebuild_error
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.stats import EngineStats

logger = logging.getLogger(__name__)


class ProcessStream(RequestStream):
    """A request's outputs from the engine process; `accepted()` waits for the child to hold
    it and raises what an in-process `submit` would have raised. Iterating waits for it too."""

    def __init__(self, engine: ProcessEngine, request_id: str) -> None:
        self.loop = asyncio.get_running_loop()
        super().__init__(request_id, asyncio.Queue(), abort=engine._post_abort, forget=engine._forget)
        self._accepted: asyncio.Future[None] = self.loop.create_future()
        self._held = False
        self.prompt: tuple[str | None, list[int]] = (None, [])   # from its first output

    async def accepted(self) -> None:
        await asyncio.shield(self._accepted)

    async def __anext__(self) -> RequestOutput:
        if not self._held and not self.closed:
            try:
                await self.accepted()
            except BaseException:
                self.finished = True       # nothing runs in the engine: nothing to abort
                self.close()
                raise
            self._held = True
        return await super().__anext__()

    def fail(self, exc: BaseException) -> None:
        if not self._accepted.done():
            self.finished = True        # refused: nothing runs in the engine, nothing to abort
            self._accepted.set_exception(exc)
            self._accepted.exception()  # raised by accepted() or iterating; never logged unread
        else:
            self._queue.put_nowait(exc)


class ProcessEngine(EngineClient, EngineAdmin):
    """`AsyncEngine(model, **kwargs)` run in a spawned child process (engine/process_child.py).
    `start_timeout_s` bounds loading the models, `call_timeout_s` each adapter call,
    `stop_timeout_s` a shutdown before the child is killed."""

    def __init__(self, model: str, *, start_timeout_s: float = 600.0, call_timeout_s: float = 30.0,
                 stop_timeout_s: float = 10.0, **kwargs: Any) -> None:
        self.config = EngineConfig(model=str(model), **kwargs)    # bad settings raise here, as in-process
        self.model = str(model)
        self.kwargs = kwargs
        self.start_timeout_s = start_timeout_s
        self.call_timeout_s = call_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        self._outbox: list[tuple] = []
        self._outbox_cv = threading.Condition()
        self._streams: dict[str, ProcessStream] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()
        self._stats = EngineStats()
        self._served: list[str] = []
        self._dead: str | None = "engine process is not running; call `await engine.start()` first"
        self._variants: dict[str, LoRARequest] = {}
        self._tenant_weights: dict[str, float] = {}

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self.process is not None:
            return
        self._outbox = []
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(target=child_main, args=(child_conn, self.model, self.kwargs),
                           name="lockgate-engine", daemon=False)   # daemonic: no rank processes
        proc.start()
        child_conn.close()
        _live.add(proc)
        try:
            served, stats = await asyncio.to_thread(_first_message, conn, proc, self.start_timeout_s)
        except BaseException:
            conn.close()
            await asyncio.to_thread(_stop, proc, 1.0)
            raise
        self.process, self._conn, self._served, self._stats = proc, conn, served, stats
        self._dead = None
        for tenant, weight in self._tenant_weights.items():
            self._send(("weight", tenant, weight))
        self._reader = threading.Thread(target=self._read, args=(conn, proc), name="lockgate-engine-reader",
                                        daemon=True)
        self._sender = threading.Thread(target=self._send_loop, args=(conn,), name="lockgate-engine-sender",
                                        daemon=True)
        self._reader.start()
        self._sender.start()

    async def shutdown(self) -> None:
        """Stop the child (a stop message, then `stop_timeout_s`, then kill); the streams
        still open get EngineDead."""
        proc = self.process
        if proc is None:
            return
        self._send(("stop",))
        await asyncio.to_thread(_stop, proc, self.stop_timeout_s)
        for t in (self._reader, self._sender):
            if t is not None:
                await asyncio.to_thread(t.join, self.stop_timeout_s)
        self.process = None
        if self._conn is not None:
            self._conn.close()

    async def __aenter__(self) -> ProcessEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def is_ready(self) -> bool:
        return self._dead is None

    # -- requests ---------------------------------------------------------------------------
    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
               **options: Unpack[SubmitOptions]) -> RequestStream:
        """Hand a request to the child; its refusals (InvalidRequest, PromptTooLong,
        EngineOverloaded) are raised by the stream's `accepted()`. EngineDead at once when
        the child is not running."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        if request_id in self._streams:
            raise InvalidRequest(f"request_id: {request_id!r} is already in the engine", field="request_id")
        stream = ProcessStream(self, request_id)
        self._streams[request_id] = stream
        self._send(("submit", request_id, prompt, sampling_params, options))
        return stream

    async def abort(self, request_id: str) -> None:
        self._post_abort(request_id)

    def _post_abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(("abort", request_id))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def stats(self) -> EngineStats:
        """The latest snapshot the child sent (at most 50 ms old while it steps)."""
        return self._stats

    def model_stats(self, model: str) -> EngineStats:
        s = self._stats
        if s.pool is None:
            return s
        own = s.by_model.get(model, EngineStats())
        return dataclasses.replace(own, overload=s.overload, pool=s.pool, residency=s.pool.models.get(model))

    def for_model(self, name: str) -> ModelBinding:
        if name not in self._served:
            raise UnknownModel(f"model: {name!r} is not served by this engine")
        return ModelBinding(self, name)

    # -- adapters and tenants ---------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        adapter: Adapter = await asyncio.wrap_future(self._call("add_lora", lora_request))
        self._variants[lora_request.lora_name] = lora_request
        return adapter

    def remove_lora(self, name: str) -> bool:
        """AdapterInUse while requests use it (the child's answer, waited for here: the call
        is a dict lookup there, bounded by `call_timeout_s`)."""
        removed = bool(self._call_sync("remove_lora", name))
        if removed:
            self._variants.pop(name, None)
        return removed

    def unload_lora(self, name: str) -> bool:
        return bool(self._call_sync("unload_lora", name))

    @property
    def loras(self) -> dict[str, LoRARequest]:
        return dict(self._variants)

    @property
    def tenant_weights(self) -> dict[str, float]:
        return dict(self._tenant_weights)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        weight = self._tenant_weights[tenant] = checked_tenant_weight(tenant, weight)
        if self._dead is None:
            self._send(("weight", tenant, weight))

    def purge_tenant(self, tenant: str) -> None:
        """A deleted tenant's cached KV blocks dropped in the child, before any request sent
        after this call looks its prefix up (one pipe: messages arrive in order)."""
        if self._dead is None:
            self._send(("purge", tenant))

    def _call(self, method: str, *args: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._dead is not None:
            fut.set_exception(EngineDead(self._dead))
            return fut
        call_id = next(self._call_ids)
        with self._lock:
            self._calls[call_id] = fut
        self._send(("call", call_id, method, args))
        timer = threading.Timer(self.call_timeout_s, self._time_out, (call_id, method))
        timer.daemon = True
        timer.start()
        fut.add_done_callback(lambda _: timer.cancel())
        return fut

    def _call_sync(self, method: str, *args: Any) -> Any:
        return self._call(method, *args).result(self.call_timeout_s + 1.0)

    def _time_out(self, call_id: int, method: str) -> None:
        with self._lock:
            fut = self._calls.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(EngineError(f"the engine process did not answer {method} within "
                                          f"{self.call_timeout_s:g} s"))

    # -- the pipe ---------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        with self._outbox_cv:
            self._outbox.append(message)
            self._outbox_cv.notify()

    def _send_loop(self, conn: Connection) -> None:
        while True:
            with self._outbox_cv:
                while not self._outbox:
                    self._outbox_cv.wait()
                batch, self._outbox = self._outbox, []
            try:
                for message in batch:
                    conn.send(message)
            except (OSError, ValueError):     # the child is gone: the reader says so
                return
            if batch[-1][0] == "stop" or self._dead is not None:
                return

    def _read(self, conn: Connection, proc: BaseProcess) -> None:
        try:
            while True:
                ready = wait([conn, proc.sentinel])
                if conn not in ready:       # exited with nothing more to read
                    break
                self._handle(conn.recv())
        except (EOFError, OSError):
            pass
        except Exception:  # a bug here must not leave callers waiting
            logger.exception("engine process reader failed")
        proc.join(1.0)
        self._die(f"engine process exited (exit code {proc.exitcode})")

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "batch":
            _, items, stats = message
            if stats is not None:
                self._stats = stats
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            for item in items:
                stream = self._streams.get(item[0])
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, item[1], item[2]))
            for loop, found in by_loop.items():
                with contextlib.suppress(RuntimeError):   # the caller's loop may be closed
                    loop.call_soon_threadsafe(_dispatch, found)
        elif kind == "reply":
            _, call_id, ok, value = message
            with self._lock:
                fut = self._calls.pop(call_id, None)
            if fut is not None and not fut.done():
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(rebuild_error(value))

    def _die(self, reason: str) -> None:
        self._dead = reason
        with self._outbox_cv:       # the sender stops on its next wake
            self._outbox.append(("stop",))
            self._outbox_cv.notify()
        with self._lock:
            calls, self._calls = self._calls, {}
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(EngineDead(reason))
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream in list(self._streams.values()):
            by_loop.setdefault(stream.loop, []).append((stream, "dead", reason))
        for loop, found in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_dispatch, found)


def _dispatch(items: list[tuple[ProcessStream, str, Any]]) -> None:
    """In the streams' event loop: one step's items, each to its stream."""
    for stream, kind, payload in items:
        if kind == "out":
            if not stream._accepted.done():
                stream._accepted.set_result(None)
            if payload.prompt_token_ids is None:      # sent once, with the first output
                payload.prompt, payload.prompt_token_ids = stream.prompt
            else:
                stream.prompt = (payload.prompt, payload.prompt_token_ids)
            stream._queue.put_nowait(payload)
        elif kind == "ok":
            if not stream._accepted.done():
                stream._accepted.set_result(None)
        elif kind == "err":
            stream.fail(rebuild_error(payload))
        elif not stream.finished:    # "dead"
            stream.fail(EngineDead(payload))


def _first_message(conn: Connection, proc: BaseProcess, timeout_s: float) -> tuple[list[str], EngineStats]:
    """The child's answer to its start: its models and first stats, or its start-up error
    raised here."""
    ready = wait([conn, proc.sentinel], timeout_s)
    if not ready:
        raise EngineError(f"the engine process did not start within {timeout_s:g} s")
    try:
        message = conn.recv() if conn in ready or conn.poll() else None
    except (EOFError, OSError):
        message = None
    if message is None:
        proc.join(1.0)
        raise EngineError(f"the engine process exited while starting (exit code {proc.exitcode})")
    if message[0] == "failed":
        raise rebuild_error(message[1])
    return message[1], message[2]


def _stop(proc: BaseProcess, timeout_s: float) -> None:
    """Wait up to `timeout_s` for the child to exit; then kill it."""
    proc.join(timeout_s)
    if proc.is_alive():
        logger.warning("engine process %s did not stop within %g s: killed", proc.pid, timeout_s)
        proc.kill()
        proc.join(5.0)
    _live.discard(proc)


# children still running when this process exits: killed, never waited on forever (they
# are not daemonic, so that they may spawn tensor-parallel ranks of their own)
_live: weakref.WeakSet[BaseProcess] = weakref.WeakSet()


@atexit.register
def _kill_live() -> None:
    for proc in list(_live):
        with contextlib.suppress(Exception):
            proc.kill()
            proc.join(2.0)
