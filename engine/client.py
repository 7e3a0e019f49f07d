"""The engine's face to a server: `EngineClient` (submit a request and read its stream of
outputs, abort, stats, readiness) and `EngineAdmin` (life cycle, adapters, tenant weights);
`ServedEngine`, both, is what a server holds for each model it serves.

A `ModelEngine` serves several models (and their adapters), each request naming its model:
`AsyncEngine` in this process, a Ray `Pool` of workers. A `ModelBinding`
(engine/binding.py) binds one of its models, or one adapter, as a `ServedEngine`.
Tokenizers, chat templates and context limits are not part of the face: a server reads
them from the model directory (`ModelConfig`, `Tokenizer`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, Unpack, runtime_checkable

from lockgate.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from lockgate.engine.lora import Adapter, LoRARequest
    from lockgate.engine.sampling_params import SamplingParams
    from lockgate.engine.stats import EngineStats

Prompt = str | list[int] | dict[str, Any]


class SubmitOptions(TypedDict, total=False):
    """A request's placement in the engine, as `submit` takes it by keyword: its tenant (the
    fairness and cache-isolation key), service class and priority within the tenant, the
    model or adapter it runs on (None: the engine's default), its cache salt, whether a
    queued request may be shed for more urgent work (see engine/admission.py), and a cache
    hint (OpenAI's `prompt_cache_key`): requests of one tenant with the same hint go to the
    pool worker that served it before, where their common prefix is likely cached; it never
    changes what is shared (that is the cache salt's) and one engine, with one cache, ignores it."""

    tenant: str
    service_class: str
    priority: int
    model: str | None
    cache_salt: str | None
    sheddable: bool
    cache_hint: str | None


class RequestStream:
    """One request's outputs, as an async iterator of cumulative `RequestOutput`s; an error
    the engine hands the request (EngineDead, a shed's EngineOverloaded) is raised from it.
    `close()` (idempotent) aborts the request unless it has finished, and forgets it.

    A reader that falls behind the engine gets the outputs waiting for it as one, its deltas
    joined (`merged`), as vLLM's output collector does: a server loop that lags its engine
    then sends one chunk per stream for several steps instead of falling further behind.
    `merge_waiting` False: every output as it came (an engine that queues them all at once,
    e.g. the load tests' instant engine, whose point is one chunk per token)."""

    merge_waiting = True

    def __init__(self, request_id: str, queue: asyncio.Queue, *, abort: Callable[[str], None],
                 forget: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._forget = forget
        self.finished = False
        self.closed = False
        self.last: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def accepted(self) -> None:
        """Wait until the engine holds the request. In-process that is already so when
        `submit` returns; a pool's stream raises here what `submit` raises in-process
        (InvalidRequest, EngineOverloaded, EngineDead), with nothing queued."""
        return None

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        while self.merge_waiting and not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):    # after what came before it
                self._queue.put_nowait(nxt)
                break
            item = merged(item, nxt)
        self.last = item
        if item.finished:
            self.finished = True
            self._forget(self.request_id)
        return item

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs, closing the stream however the reader leaves (`generate`'s body)."""
        try:
            async for out in self:
                yield out
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self._abort(self.request_id)
        self._forget(self.request_id)


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """`later` (cumulative) with each completion's delta reaching back over `earlier`'s."""
    before = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        prev = before.get(c.index)
        if prev is not None:
            c.delta_text = prev.delta_text + c.delta_text
            c.delta_token_ids = prev.delta_token_ids + c.delta_token_ids
    return later


@runtime_checkable
class EngineClient(Protocol):
    """Requests in, streams out."""

    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
               **options: Unpack[SubmitOptions]) -> RequestStream:
        """Queue a request now and return its stream. Raises at once, with nothing queued:
        InvalidRequest (its `field`; PromptTooLong, UnknownModel, LoRAError among them),
        EngineOverloaded (the queue is full), EngineDead (not running)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats:
        """A snapshot taken after the latest step (safe from any thread)."""
        ...

    @property
    def is_ready(self) -> bool:
        """Started: its models are loaded and `submit` takes requests."""
        ...


def checked_tenant_weight(tenant: str, weight: float) -> float:
    """`set_tenant_weight`'s arguments checked (ValueError naming the field), the weight as a float."""
    if not isinstance(tenant, str) or not tenant:
        raise ValueError(f"tenant: must be a non-empty string, got {tenant!r}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        raise ValueError(f"weight: must be a number > 0, got {weight!r}")
    return float(weight)


@runtime_checkable
class EngineAdmin(Protocol):
    """Life cycle, adapters and tenant weights."""

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        """Read, check and serve an adapter under its name (`submit(..., model=name)`).
        Raises LoRAError (its `field`); nothing is registered then."""
        ...

    def remove_lora(self, name: str) -> bool:
        """Stop serving an adapter; AdapterInUse while requests use it."""
        ...

    def unload_lora(self, name: str) -> bool:
        """Drop an adapter's weights, keep serving it (read again on its next use)."""
        ...

    @property
    def loras(self) -> dict[str, LoRARequest]:
        """The adapters served, by name."""
        ...

    @property
    def tenant_weights(self) -> dict[str, float]: ...

    def set_tenant_weight(self, tenant: str, weight: float) -> None: ...

    def purge_tenant(self, tenant: str) -> None:
        """A deleted tenant's cached KV blocks dropped, from the device and the host tier."""
        ...


@runtime_checkable
class ServedEngine(EngineClient, EngineAdmin, Protocol):
    """Both faces: what a server holds for each model it serves."""


@runtime_checkable
class ModelEngine(EngineClient, EngineAdmin, Protocol):
    """An engine of several models: `submit(..., model=name)` picks one (or an adapter),
    `add_lora` takes the adapter's base model from `lora_request.base_model_name`, and
    `model_stats(name)` is one model's share of `stats()`."""

    def model_stats(self, model: str) -> EngineStats: ...
