"""Tokenization and chat templating off the event loop (`TokenizePool`).

A 1 MB prompt takes about a second to render and tokenize, and that work holds the GIL (the
`tokenizers` call and the template's Jinja both do), so on the loop, or on a thread, it stalls
every other tenant's request. Small inputs (under `inline_chars` characters, the common case)
are still done inline: no IPC for them. Larger ones go to a few worker processes
(`ProcessPoolExecutor`, started with "spawn": the gateway has threads, so never "fork").

Each worker reads a model directory once (`read_model_info`, as the gateway did at start-up)
and keeps it; a job carries only the model's name, directory and context, and the text. A
worker imports the engine's face and transformers, and with them torch (transformers' tokenizer
classes import it whatever the engine does), so it starts in a few seconds and holds a few
hundred MB; it starts on the first large job, not at start-up.

Bounds, each an exception the routes map to a 503 (`TokenizerError`): at most `workers` jobs
running and `max_queued` waiting (past that `TokenizerBusy`, at once); every wait at most
`timeout_s`; a worker that dies fails the jobs it had (`TokenizerUnavailable`, never a hang)
and the pool is replaced for the next job. A job's own error (a template's, the
`ValueError`s of `ModelInfo.chat_prompt_ids`) comes back as the same type and message.

Shared fairly between tenants: waiting jobs are queued per tenant (`tenant`, by default the
request's: `current_tenant`, set at admission) and handed to the workers one tenant at a
time in turn, so a tenant's wait does not grow with another's backlog. When `max_queued` are
waiting, a newcomer takes the place of the newest job of the tenant holding the most, unless
its own tenant holds as many: only a tenant holding the largest share is ever busy.

A prompt that can never fit the model's context (`gateway.prompt_bound`: its bytes alone
need more tokens than `max_model_len - 1`) is refused (`PromptTooLong`) before it is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import multiprocessing
import pickle
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from lockgate.gateway import prompt_bound
from lockgate.gateway.model_catalog import ModelInfo, read_model_info

logger = logging.getLogger(__name__)

ModelSpec: TypeAlias = tuple[str, str, int]     # name, directory, max_model_len: what a worker reads
Message: TypeAlias = dict[str, Any]


current_tenant: contextvars.ContextVar[str | None] = contextvars.ContextVar("tokenize_tenant", default=None)
"""The tenant whose request is being served (set at admission): whose queue its jobs join."""


class TokenizerError(Exception):
    """The pool did not tokenize the input: not the input's fault (a 503), except
    `PromptTooLong`."""


class PromptTooLong(TokenizerError):
    """The input needs at least `min_tokens` tokens, more than the model's context leaves a
    prompt (at least one token goes to the completion): a 400 naming `param`."""

    def __init__(self, min_tokens: int, max_model_len: int, param: str) -> None:
        super().__init__(f"{param}: at least {min_tokens} tokens, over the context of {max_model_len}")
        self.min_tokens = min_tokens
        self.max_model_len = max_model_len
        self.param = param


class TokenizerBusy(TokenizerError):
    """Every worker busy and `max_queued` jobs already waiting: retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TokenizerUnavailable(TokenizerError):
    """A worker died with the job, the job ran past the timeout, or the pool is closed."""


# -- in the worker process --------------------------------------------------------------------
_WORKER_MODELS: dict[ModelSpec, ModelInfo] = {}


def _worker_model(spec: ModelSpec) -> ModelInfo:
    """The model `spec` names, read on its first job in this worker and kept."""
    info = _WORKER_MODELS.get(spec)
    if info is None:
        name, path, max_model_len = spec
        info = _WORKER_MODELS[spec] = read_model_info(name, path, max_model_len=max_model_len)
    return info


def _portable(exc: Exception) -> Exception:
    """`exc`, or a ValueError with its message where it would not come back as itself (an
    exception the parent could not unpickle would break the whole pool)."""
    try:
        back = pickle.loads(pickle.dumps(exc))  # noqa: S301 - our own bytes, just made
    except Exception:  # noqa: BLE001 - any failure: send the message alone
        return ValueError(str(exc))
    return exc if type(back) is type(exc) and str(back) == str(exc) else ValueError(str(exc))


def _chat_in_worker(spec: ModelSpec, chat: tuple[list[Message], list[Message] | None, Message | None]) -> list[int]:
    try:
        return _worker_model(spec).chat_prompt_ids(*chat)
    except Exception as exc:  # noqa: BLE001 - re-raised as itself where it travels
        raise _portable(exc) from None


def _encode_in_worker(spec: ModelSpec, text: str) -> list[int]:
    try:
        return _worker_model(spec).encode(text)
    except Exception as exc:  # noqa: BLE001 - re-raised as itself where it travels
        raise _portable(exc) from None


# -- in the gateway -----------------------------------------------------------------------------
def chat_chars(messages: list[Message]) -> int:
    """The characters of a chat that its work grows with: the messages' content and names."""
    return sum(len(m.get("content") or "") + len(m.get("name") or "") for m in messages)


@dataclass(eq=False)
class _Job:
    fn: Callable[[ModelSpec, Any], list[int]]
    spec: ModelSpec
    arg: Any
    tenant: str
    done: asyncio.Future[list[int]]
    running: Future[list[int]] | None = field(default=None)     # once handed to a worker


class TokenizePool:
    """`chat_prompt_ids` and `encode` as `ModelInfo`'s, with inputs of `inline_chars` or more
    characters done by up to `workers` processes. Processes start on the first large job;
    `close()` stops them. Used from one event loop."""

    def __init__(self, *, workers: int = 1, inline_chars: int = 8_192, max_queued: int = 16,
                 timeout_s: float = 30.0, start_method: str = "spawn") -> None:
        if workers < 1 or max_queued < 0 or inline_chars < 0 or not timeout_s > 0:
            raise ValueError("TokenizePool: workers >= 1, max_queued >= 0, inline_chars >= 0, timeout_s > 0")
        if start_method == "fork":
            raise ValueError("TokenizePool: 'fork' is unsafe in a process with threads")
        self.workers = workers
        self.inline_chars = inline_chars
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context(start_method)
        self._executor: ProcessPoolExecutor | None = None
        # waiting jobs by tenant, in turn order: the first tenant's oldest job goes next
        self._queues: dict[str, deque[_Job]] = {}
        self._queued = 0
        self._running = 0                 # handed to the workers and not yet finished
        self._closed = False

    @property
    def num_jobs(self) -> int:
        """Large inputs in hand: running or waiting."""
        return self._running + self._queued

    async def chat_prompt_ids(self, info: ModelInfo, messages: list[Message],
                              tools: list[Message] | None = None, *, bound: bool = True,
                              tenant: str | None = None, options: Message | None = None) -> list[int]:
        """`info.chat_prompt_ids(messages, tools, options)`: the same ids, the same exceptions (and the
        pool's own `TokenizerError`s; with `bound`, `PromptTooLong` for a chat that cannot
        fit). `tenant`: whose queue a large chat joins (default: `current_tenant`)."""
        if chat_chars(messages) < self.inline_chars:
            return info.chat_prompt_ids(messages, tools, options)
        if bound:
            await self._check_fits(info, messages, "messages")
        return await self._run(_chat_in_worker, info, (messages, tools, options), tenant)

    async def encode(self, info: ModelInfo, text: str, *, bound: bool = True,
                     tenant: str | None = None) -> list[int]:
        """`info.encode(text)`: the same ids, the same exceptions (and `TokenizerError`s, as
        `chat_prompt_ids`'s)."""
        if len(text) < self.inline_chars:
            return info.encode(text)
        if bound:
            await self._check_fits(info, text, "prompt")
        return await self._run(_encode_in_worker, info, text, tenant)

    @staticmethod
    async def _check_fits(info: ModelInfo, what: Any, param: str) -> None:
        """`PromptTooLong` when the input (messages, or a prompt's text) needs more tokens than
        a prompt may have. The tokenizer's bounds are learnt once, on a thread."""
        if not prompt_bound.known(info.tokenizer):
            await asyncio.to_thread(prompt_bound.learn, info.tokenizer)
        measure = prompt_bound.min_chat_tokens if param == "messages" else prompt_bound.min_tokens
        least = measure(info.tokenizer, what)
        if least > info.max_model_len - 1:
            raise PromptTooLong(least, info.max_model_len, param)

    async def _run(self, fn: Callable[[ModelSpec, Any], list[int]], info: ModelInfo, arg: Any,
                   tenant: str | None) -> list[int]:
        job = self._enqueue(fn, (info.name, str(info.path), info.max_model_len), arg, tenant)
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                return await job.done
        except TimeoutError:
            self._abandon(job)
            if deadline.expired():   # waiting: dropped; running: its worker ends it
                raise TokenizerUnavailable(f"tokenizing took longer than {self.timeout_s:g} s") from None
            raise
        except asyncio.CancelledError:
            self._abandon(job)
            raise

    def _enqueue(self, fn: Callable[[ModelSpec, Any], list[int]], spec: ModelSpec, arg: Any,
                 tenant: str | None) -> _Job:
        """The job handed to a worker, or waiting its tenant's turn; `TokenizerBusy` when the
        queue is full and this tenant holds as many of its places as any other."""
        if self._closed:
            raise TokenizerUnavailable("the tokenizer pool is closed")
        who = tenant if tenant is not None else (current_tenant.get() or "")
        job = _Job(fn, spec, arg, who, asyncio.get_running_loop().create_future())
        if self._running < self.workers and not self._queued:
            self._start(job)
            return job
        if self._queued >= self.max_queued:
            self._make_room(who)
        self._queues.setdefault(who, deque()).append(job)
        self._queued += 1
        return job

    def _make_room(self, who: str) -> None:
        """Shed the newest job of the tenant holding the most places, if it holds more than
        `who` does; else `who` is the one refused."""
        mine = len(self._queues.get(who, ()))
        hog = max(self._queues, key=lambda t: len(self._queues[t]), default=None)
        if hog is None or len(self._queues[hog]) <= mine:
            raise TokenizerBusy(f"the tokenizer is busy ({self.num_jobs} large inputs in hand, "
                                f"{mine} of them this tenant's); retry shortly")
        shed = self._queues[hog].pop()
        if not self._queues[hog]:
            del self._queues[hog]
        self._queued -= 1
        if not shed.done.done():
            shed.done.set_exception(TokenizerBusy("the tokenizer is busy (this tenant holds the "
                                                  "most of its queue); retry shortly"))

    def _abandon(self, job: _Job) -> None:
        """Its waiter gave up: a waiting job leaves its queue; a running one is cancelled if
        its worker has not taken it yet (else it runs on, counted, until it ends)."""
        queue = self._queues.get(job.tenant)
        if queue is not None and job in queue:
            queue.remove(job)
            self._queued -= 1
            if not queue:
                del self._queues[job.tenant]
        elif job.running is not None:
            job.running.cancel()

    def _dispatch(self) -> None:
        """Hand waiting jobs to free workers, one tenant at a time in turn."""
        while self._running < self.workers and self._queues:
            tenant = next(iter(self._queues))
            queue = self._queues.pop(tenant)
            job = queue.popleft()
            self._queued -= 1
            if queue:
                self._queues[tenant] = queue          # to the back of the turn
            if job.done.done():
                continue
            try:
                self._start(job)
            except Exception as exc:  # noqa: BLE001 - whatever stops the hand-over fails this job only
                job.done.set_exception(TokenizerUnavailable(f"the tokenizer could not take the input: {exc}"))

    def _start(self, job: _Job) -> None:
        """Hand `job` to a worker (a broken pool replaced first); counted until it ends."""
        executor = self._current()
        try:
            running = executor.submit(job.fn, job.spec, job.arg)
        except BrokenProcessPool:    # a worker died while the pool was idle
            self._replace(executor)
            executor = self._current()
            running = executor.submit(job.fn, job.spec, job.arg)
        self._running += 1
        job.running = running
        loop = job.done.get_loop()

        def back(f: Future[list[int]]) -> None:     # on the executor's thread
            with contextlib.suppress(RuntimeError):     # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(self._finished, job, executor, f)

        running.add_done_callback(back)

    def _finished(self, job: _Job, executor: ProcessPoolExecutor, f: Future[list[int]]) -> None:
        self._running -= 1
        exc = None if f.cancelled() else f.exception()
        if isinstance(exc, BrokenProcessPool):
            self._replace(executor)
            exc = TokenizerUnavailable("a tokenizer worker stopped while holding this input")
        if not job.done.done():
            if f.cancelled():
                job.done.set_exception(TokenizerUnavailable("the tokenizer pool closed with this input waiting"))
            elif exc is not None:
                job.done.set_exception(exc)
            else:
                job.done.set_result(f.result())
        if not self._closed:
            self._dispatch()

    def _current(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(self.workers, mp_context=self._context)
        return self._executor

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        """A broken pool put aside (once, however many of its jobs noticed); the next job
        starts a new one. Its workers were already stopped by the executor."""
        if broken is self._executor:
            logger.error("a tokenizer worker stopped abruptly: the pool is replaced")
            self._executor = None
            broken.shutdown(wait=False, cancel_futures=True)

    def worker_pids(self) -> list[int]:
        """The worker processes' ids now (none before the first large job)."""
        executor = self._executor
        processes = executor._processes if executor is not None else None   # the executor's own map
        return sorted(processes or {})

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop the workers: jobs waiting fail, those running get `timeout_s` to end, then
        their processes are killed. New jobs are refused from here on."""
        self._closed = True
        for queue in self._queues.values():
            for job in queue:
                if not job.done.done():
                    job.done.set_exception(TokenizerUnavailable("the tokenizer pool closed with this input waiting"))
        self._queues.clear()
        self._queued = 0
        executor, self._executor = self._executor, None
        if executor is None:
            return
        processes = dict(executor._processes or {})
        shutdown = asyncio.ensure_future(asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True))
        done, _ = await asyncio.wait([shutdown], timeout=timeout_s)
        if not done:
            logger.warning("tokenizer workers still busy %g s after close: killed", timeout_s)
            for process in processes.values():
                process.kill()
            await shutdown
