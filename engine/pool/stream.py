"""`RemoteStream`: a request's outputs read from its pool worker by a pump task.

Every Ray call is bounded by the pool's `call_timeout_s` except the wait for a request's next
output, which the gateway's `request_timeout_s` bounds. A worker that dies mid-request: a
request that had sent nothing is retried once on another worker; one that had sent tokens
ends with `EngineDead`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from lockgate.engine.client import Prompt, RequestStream
from lockgate.engine.errors import EngineDead
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lockgate.engine.pool.replica import Pool

logger = logging.getLogger(__name__)


class RemoteStream(RequestStream):
    """A request's outputs read from its worker by a pump task; `accepted()` waits for the
    worker to take it (raising what `submit` would have raised)."""

    def __init__(self, pool: Pool, model: str, worker: str, prompt: Prompt,
                 params: SamplingParams, request_id: str, kwargs: dict[str, Any],
                 prefix: list[bytes] | None = None, prefill: int = 0) -> None:
        """`prefill`: the prompt tokens the router expects `worker` to compute for it (counted
        in `pool.pending` until its first output)."""
        self.pool = pool
        self.worker = worker
        self._prefill = prefill
        pool.pending[worker] += prefill
        self._prefix = prefix or []
        queue: asyncio.Queue = asyncio.Queue()
        super().__init__(request_id, queue, abort=self._abort_remote, forget=self._forget_remote)
        loop = asyncio.get_running_loop()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._model = model
        self._forgotten = False
        pool.inflight[worker] += 1
        self._task = loop.create_task(self._pump(prompt, params, kwargs))

    async def accepted(self) -> None:
        await asyncio.shield(self._accepted)

    def _fail(self, exc: BaseException) -> None:
        if not self._accepted.done():
            self._accepted.set_exception(exc)
        else:
            self._queue.put_nowait(exc)

    async def _pump(self, prompt: Prompt, params: SamplingParams, kwargs: dict[str, Any]) -> None:
        """Read the request's outputs; whatever goes wrong ends the stream with an error (its
        acceptance, if still awaited, fails), never silently."""
        try:
            await self._attempts(prompt, params, kwargs)
        except asyncio.CancelledError:
            if not self._accepted.done():
                self._accepted.set_exception(EngineDead(f"request {self.request_id} was aborted"))
            raise
        except Exception as exc:  # noqa: BLE001 - any failure: the request ends with EngineDead
            logger.warning("pool: request %s on %s failed: %r", self.request_id, self.worker, exc)
            self._fail(EngineDead(f"pool worker {self.worker}: {type(exc).__name__}: {exc}"))

    async def _attempts(self, prompt: Prompt, params: SamplingParams, kwargs: dict[str, Any]) -> None:
        pool = self.pool
        for attempt in (0, 1):
            sent = False
            handle = pool.handles[self.worker]
            try:
                gen = handle.generate.remote(pool.owner, prompt, params, self.request_id, kwargs,
                                             self._prefix)
                ref = await pool._bounded(gen.__anext__())
                kind, value = await pool._bounded(ref)
                if kind == "error" and isinstance(value, EngineDead) and attempt == 0:
                    raise _WorkerCannotServe(str(value))      # retried on another worker
                if kind == "error":
                    self._fail(value)
                    return
                if not self._accepted.done():      # (a retry was accepted before)
                    self._accepted.set_result(None)
                async for ref in gen:
                    kind, value = await ref
                    if kind == "out":
                        sent = True
                        self._prefilled()
                    self._queue.put_nowait(value)
                    if kind == "error" or (isinstance(value, RequestOutput) and value.finished):
                        return
                self._fail(EngineDead(f"worker {self.worker} ended the request unfinished"))
                return
            except StopAsyncIteration:
                self._fail(EngineDead(f"worker {self.worker} ended the request without an answer"))
                return
            except pool._retryable(_WorkerCannotServe) as exc:
                pool.down.add(self.worker)
                logger.warning("pool: worker %s failed on %s: %r", self.worker, self.request_id, exc)
                if attempt == 0 and not sent:
                    try:
                        other = pool.route(self._model, kwargs.get("tenant", "default"),
                                           kwargs.get("cache_salt"), prompt_ids(prompt), exclude=self.worker)
                    except EngineDead:
                        other = None
                    if other is not None:
                        try:    # a slow, not dead, worker may hold it: abort it there
                            handle.abort.remote(self.request_id)
                        except Exception:  # noqa: BLE001 - gone: nothing runs there
                            logger.debug("pool: abort of %s not sent", self.request_id)
                        pool.inflight[self.worker] -= 1
                        pool.inflight[other] += 1
                        pool.pending[self.worker] -= self._prefill
                        pool.pending[other] += self._prefill
                        self.worker = other
                        continue
                self._fail(EngineDead(f"pool worker {self.worker} failed: {type(exc).__name__}"))
                return

    def _abort_remote(self, request_id: str) -> None:
        self._task.cancel()
        try:
            self.pool.handles[self.worker].abort.remote(request_id)
        except Exception:  # the worker is gone: nothing runs there
            logger.debug("pool: abort of %s not sent", request_id, exc_info=True)

    def _forget_remote(self, request_id: str) -> None:
        # called when the stream finishes and again when it is closed: counted down once
        if not self._forgotten:
            self._forgotten = True
            self.pool.inflight[self.worker] -= 1
            self._prefilled()

    def _prefilled(self) -> None:
        """Its prompt is computed (or it ended): no longer queued prefill on its worker."""
        if self._prefill:
            self.pool.pending[self.worker] -= self._prefill
            self._prefill = 0


class _WorkerCannotServe(Exception):
    """The worker answered that it cannot serve (not started yet, or its engine stopped)."""


def prompt_ids(prompt: Prompt) -> list[int] | None:
    if isinstance(prompt, list):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt_token_ids"), list):
        return prompt["prompt_token_ids"]
    return None
