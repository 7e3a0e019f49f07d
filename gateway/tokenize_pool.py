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
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeAlias

from lockgate.gateway.model_catalog import ModelInfo, read_model_info

logger = logging.getLogger(__name__)

ModelSpec: TypeAlias = tuple[str, str, int]     # name, directory, max_model_len: what a worker reads
Message: TypeAlias = dict[str, Any]


class TokenizerError(Exception):
    """The pool could not tokenize the input (not the input's fault): a 503."""


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


def _chat_in_worker(spec: ModelSpec, chat: tuple[list[Message], list[Message] | None]) -> list[int]:
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


class TokenizePool:
    """`chat_prompt_ids` and `encode` as `ModelInfo`'s, with inputs of `inline_chars` or more
    characters done by up to `workers` processes. Processes start on the first large job;
    `close()` stops them."""

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
        self._lock = threading.Lock()     # num_jobs is released from the executor's thread
        self._num_jobs = 0                # submitted and not yet finished: running or waiting
        self._closed = False

    @property
    def num_jobs(self) -> int:
        return self._num_jobs

    async def chat_prompt_ids(self, info: ModelInfo, messages: list[Message],
                              tools: list[Message] | None = None) -> list[int]:
        """`info.chat_prompt_ids(messages, tools)`: the same ids, the same exceptions (and the
        pool's own `TokenizerError`s)."""
        if chat_chars(messages) < self.inline_chars:
            return info.chat_prompt_ids(messages, tools)
        return await self._run(_chat_in_worker, info, (messages, tools))

    async def encode(self, info: ModelInfo, text: str) -> list[int]:
        """`info.encode(text)`: the same ids, the same exceptions (and `TokenizerError`s)."""
        if len(text) < self.inline_chars:
            return info.encode(text)
        return await self._run(_encode_in_worker, info, text)

    async def _run(self, fn: Callable[[ModelSpec, Any], list[int]], info: ModelInfo, arg: Any) -> list[int]:
        future, executor = self._submit(fn, (info.name, str(info.path), info.max_model_len), arg)
        deadline = asyncio.timeout(self.timeout_s)
        try:
            async with deadline:
                return await asyncio.wrap_future(future)
        except BrokenProcessPool:
            self._replace(executor)
            raise TokenizerUnavailable("a tokenizer worker stopped while holding this input") from None
        except TimeoutError:
            if deadline.expired():   # waiting: dropped (the wait's cancel); running: its worker ends it
                raise TokenizerUnavailable(f"tokenizing took longer than {self.timeout_s:g} s") from None
            raise
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if future.cancelled() and task is not None and not task.cancelling():   # by close()
                raise TokenizerUnavailable("the tokenizer pool closed with this input waiting") from None
            raise

    def _submit(self, fn: Callable[..., list[int]], spec: ModelSpec,
                arg: Any) -> tuple[Future[list[int]], ProcessPoolExecutor]:
        """The job on the pool (a broken pool replaced first), counted until it finishes."""
        if self._closed:
            raise TokenizerUnavailable("the tokenizer pool is closed")
        with self._lock:
            if self._num_jobs >= self.workers + self.max_queued:
                raise TokenizerBusy(f"the tokenizer is busy ({self._num_jobs} large inputs in hand); "
                                    "retry shortly")
            self._num_jobs += 1
        try:
            executor = self._current()
            try:
                future = executor.submit(fn, spec, arg)
            except BrokenProcessPool:    # a worker died while the pool was idle
                self._replace(executor)
                executor = self._current()
                future = executor.submit(fn, spec, arg)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(self._release)
        return future, executor

    def _release(self, _future: Future[list[int]] | None = None) -> None:
        with self._lock:
            self._num_jobs -= 1

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
        """Stop the workers: jobs waiting are cancelled, those running get `timeout_s` to end,
        then their processes are killed. New jobs are refused from here on."""
        self._closed = True
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
