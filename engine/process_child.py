"""The engine process's side of `ProcessEngine` (engine/process.py): an `AsyncEngine` in a
spawned child, reading requests from its end of a pipe and sending back, in one message after
each step, every output, acceptance and error of that step.

Two threads share the pipe's sending side: the child's event loop (acceptances, refusals and
RPC replies, flushed after each batch of incoming messages) and the engine's step loop (its
outputs, flushed at the top of each turn, before the next step). One lock orders them.
The parent going away (its end closed, whatever the cause) stops the engine and the child.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import pickle
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from lockgate.engine import threads
from lockgate.engine.async_engine import AsyncEngine
from lockgate.engine.errors import EngineError
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.step_engine import StepEngine

logger = logging.getLogger(__name__)

STATS_EVERY_S = 0.05       # a stats snapshot rides with a batch at most this often


def error_payload(exc: BaseException) -> tuple[type[BaseException], tuple, dict]:
    """An exception as (class, args, attributes): the engine's errors take keyword-only
    arguments (`field`, `retry_after`), which plain pickling would lose on the way back."""
    payload = (type(exc), exc.args, dict(getattr(exc, "__dict__", {})))
    try:
        pickle.dumps(payload)
    except Exception:  # noqa: BLE001 - an error that cannot travel goes as its text
        return (EngineError, (f"{type(exc).__name__}: {exc}",), {})
    return payload


def rebuild_error(payload: tuple[type[BaseException], tuple, dict]) -> BaseException:
    cls, args, attrs = payload
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(attrs)
    return exc


class ChildEngine(AsyncEngine):
    """`AsyncEngine` whose deliveries go into one batch for the pipe instead of each caller's
    queue: requests are submitted by the child's event loop on the parent's behalf."""

    def __init__(self, conn: Connection, model: str, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self.conn = conn
        self.send_lock = threading.Lock()
        self._batch: list[tuple[str, str, Any]] = []
        self._batch_lock = threading.Lock()
        self._stats_at = 0.0
        self._sent: set[str] = set()    # requests whose first output (with the prompt) has gone

    def send(self, message: tuple) -> None:
        with self.send_lock:
            self.conn.send(message)

    def put(self, request_id: str, kind: str, payload: Any) -> None:
        with self._batch_lock:
            self._batch.append((request_id, kind, payload))

    def flush(self) -> None:
        """Send what the batch holds (and, at most every STATS_EVERY_S, a stats snapshot)."""
        now = time.monotonic()
        stats = self.stats() if now - self._stats_at >= STATS_EVERY_S else None
        with self.send_lock:
            with self._batch_lock:
                items, self._batch = self._batch, []
            if not items and stats is None:
                return
            if stats is not None:
                self._stats_at = now
            try:
                self.conn.send(("batch", items, stats))
            except (OSError, ValueError):   # the parent is gone: the event loop stops us
                logger.debug("engine process: parent gone, %d items dropped", len(items))

    def _deliver_all(self, items: list[tuple[str, Any]]) -> None:
        for request_id, item in items:      # into the step's one message (`flush`)
            self._deliver(request_id, item)

    def _deliver(self, request_id: str, item: Any) -> None:
        with self._lock:
            if request_id not in self._streams:
                return
        if isinstance(item, BaseException):
            self._forget(request_id)
            self.put(request_id, "err", error_payload(item))
            return
        if isinstance(item, RequestOutput):
            if request_id in self._sent:
                # the parent keeps the prompt from the request's first output: later ones
                # travel without it (most of their bytes on a long prompt)
                item = copy.copy(item)
                item.prompt, item.prompt_token_ids = None, None
            else:
                self._sent.add(request_id)
            if item.finished:
                self._forget(request_id)
        self.put(request_id, "out", item)

    def _forget(self, request_id: str) -> None:
        self._sent.discard(request_id)
        super()._forget(request_id)

    def _drain_inbox(self, core: StepEngine) -> int:
        # the top of each turn of the step loop: the previous step's outputs go out now
        self.flush()
        return super()._drain_inbox(core)

    def served_models(self) -> list[str]:
        core = self._core
        cores = list(getattr(core, "cores", {}).values()) or [core.core_for(None)]
        return sorted({name for c in cores for name in c.served_model_names})

    def handle(self, message: tuple) -> bool:
        """One message from the parent; False for a stop."""
        kind = message[0]
        if kind == "submit":
            _, rid, prompt, params, options = message
            try:
                self.submit(prompt, params, rid, **options)
            except Exception as exc:  # noqa: BLE001 - the caller's refusal, raised in the parent
                self.put(rid, "err", error_payload(exc))
            else:
                self.put(rid, "ok", None)
        elif kind == "abort":
            self._post_abort(message[1])
            self._forget(message[1])
        elif kind == "weight":
            self.set_tenant_weight(message[1], message[2])
        elif kind == "purge":
            purge = getattr(self, "purge_tenant", None)     # engines with a KV tier to purge
            if purge is not None:
                purge(message[1])
        elif kind == "call":
            asyncio.get_running_loop().create_task(self._call(*message[1:]))
        elif kind == "stop":
            return False
        return True

    async def _call(self, call_id: int, method: str, args: tuple) -> None:
        try:
            result = getattr(self, method)(*args)
            if asyncio.iscoroutine(result):
                result = await result
            reply: tuple = ("reply", call_id, True, result)
        except Exception as exc:  # noqa: BLE001 - raised in the parent's caller
            reply = ("reply", call_id, False, error_payload(exc))
        try:
            self.send(reply)
        except (OSError, ValueError):
            logger.debug("engine process: parent gone before the reply to %s", method)


def child_main(conn: Connection, model: str, kwargs: dict[str, Any]) -> None:
    """The spawned process's entry point. A terminal's Ctrl-C (the whole process group's
    SIGINT) or a group's SIGTERM is the parent's to act on: it drains its requests, then stops
    this child; the child going first would cut them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # the server's CPU is not a neighbour's to the engine's thread governor: in one process it
    # was the engine's own, and counting it as a stolen core narrows every step for it
    threads.partner_pids.add(os.getppid())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s engine-process %(levelname)s %(message)s")
    try:
        asyncio.run(_serve(conn, model, kwargs))
    finally:
        conn.close()


async def _serve(conn: Connection, model: str, kwargs: dict[str, Any]) -> None:
    try:
        engine = ChildEngine(conn, model, **kwargs)
        await engine.start()
    except Exception as exc:  # noqa: BLE001 - the parent raises it from start()
        conn.send(("failed", error_payload(exc)))
        return
    engine.send(("ready", engine.served_models(), engine.stats()))
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        try:
            while conn.poll():
                if not engine.handle(conn.recv()):
                    raise EOFError
        except (EOFError, OSError):    # a stop, or the parent went away
            loop.remove_reader(conn.fileno())
            if not done.done():
                done.set_result(None)
        engine.flush()

    loop.add_reader(conn.fileno(), readable)
    try:
        await done
    finally:
        await engine.shutdown()
        engine.flush()
