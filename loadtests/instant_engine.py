"""`InstantEngine`: a stand-in for `AsyncEngine` that answers at once, for benchmarking the
gateway (the thing under test) without a model's compute in the way.

    engine = InstantEngine(model_dir)          # any demo model directory: its tokenizer is real
    await engine.start()
    stream = engine.submit(ids, SamplingParams(max_tokens=8), "req-1", tenant="t")
    async for out in stream: ...                # cumulative RequestOutputs, one per token
    stream.close()

It is an `EngineClient` and `EngineAdmin` (engine/client.py), as AsyncEngine is:
`submit(prompt, params, request_id, *, tenant, service_class, priority, model, cache_salt,
sheddable)` raising InvalidRequest / PromptTooLong / EngineOverloaded / EngineDead before
anything is queued and returning a `RequestStream` (async iteration, idempotent `close()`
that aborts an unfinished request); `generate`, `abort`, `stats()`, `is_ready`; `start()`,
`shutdown()`, `tenant_weights`, `set_tenant_weight`, and adapters (it serves none:
`add_lora` refuses with LoRAError). `tokenizer`, `model_config` and `max_model_len` are the
model directory's own.

What it does instead of generating: each request gets min(max_tokens, `max_output_tokens`)
tokens (16 by default) taken from a fixed sentence encoded by the model's tokenizer, with
real incremental text, all outputs queued on submit (so the caller never waits for it).
Finish reason "length" when max_tokens was the cap, else "stop". Stop strings, seeds and
penalties are accepted and ignored; `logprobs` are filled with fixed values of the right shape.

A stand-in that answers otherwise (tests/support/fake_served_engine.py's, which paces its
tokens) subclasses it and overrides the hooks: `sentence`, `_set_answer` (what `start` makes
of the sentence), `_outputs` (a request's outputs, a list or made lazily), `_feed` (how they
reach the stream: here all at once, with no task), and `_overloaded` (a refusal past the bound).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any, Unpack

from lockgate.engine import (
    Adapter,
    CompletionOutput,
    EngineDead,
    EngineOverloaded,
    EngineStats,
    InvalidRequest,
    Logprob,
    LoRAError,
    LoRARequest,
    ModelConfig,
    ModelEngine,
    Prompt,
    RequestMetrics,
    RequestOutput,
    RequestStream,
    SamplingParams,
    SubmitOptions,
    Tokenizer,
)
from lockgate.engine.engine_core import check_request
from lockgate.engine.llm import to_token_ids
from lockgate.engine.request import EngineRequest

SENTENCE = (" The quick brown fox jumps over the lazy dog, and the gateway answers every"
            " request at once so that only its own overhead is left to measure.")


class InstantEngine(ModelEngine):
    sentence = SENTENCE                 # what every request is answered with
    kind = "the instant engine"         # how it names itself refusing an adapter
    logprob_alternatives_from = 0       # the first token id a logprobs entry offers as an alternative

    def __init__(self, model: str | Path, *, max_output_tokens: int = 16,
                 per_token_outputs: bool = True, max_model_len: int | None = None,
                 max_waiting_per_class: int = 100_000,
                 service_classes: tuple[str, ...] = ("priority", "online", "offline"),
                 **ignored: Any) -> None:
        """`ignored`: AsyncEngine's other keyword arguments (kv_cache_memory, max_num_seqs...),
        accepted so the same `engine_kwargs` work with either engine."""
        model = Path(model)
        if not model.is_dir():
            raise ValueError(f"model must be a model directory; {str(model)!r} is not one")
        if not isinstance(max_output_tokens, int) or max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be an integer >= 1, got {max_output_tokens!r}")
        self.model_dir = model
        self.max_output_tokens = max_output_tokens
        self.per_token_outputs = per_token_outputs
        self._max_model_len_setting = max_model_len
        self.max_waiting_per_class = max_waiting_per_class
        self.service_classes = tuple(service_classes)
        self.ignored_kwargs = dict(ignored)
        self._loaded = False
        self._tokenizer: Tokenizer | None = None
        self._model_config: ModelConfig | None = None
        self._max_model_len = 0
        # open id -> (service class, tenant, queue, the task feeding the queue or None)
        self._streams: dict[str, tuple[str, str, asyncio.Queue, asyncio.Task | None]] = {}
        self._tenant_weights: dict[str, float] = {}
        self._running = False
        self._answer_ids: list[int] = []
        self._texts: list[str] = []                 # cumulative text after k tokens
        # counters, for tests and the benchmark's report
        self.num_submitted = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_generated_tokens = 0

    # -- life cycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        if not self._loaded:
            await asyncio.to_thread(self._load)
            self._loaded = True
        self._running = True

    def _load(self) -> None:
        mc = ModelConfig.from_dir(self.model_dir)
        tok = Tokenizer(self.model_dir)
        self._max_model_len = mc.context_length(self._max_model_len_setting)
        ids = tok.encode(self.sentence, add_special_tokens=False)
        special = tok.special_token_ids | set(mc.eos_token_ids)
        self._set_answer(tok, [t for t in ids if t not in special])
        self._tokenizer, self._model_config = tok, mc

    def _set_answer(self, tok: Tokenizer, ids: list[int]) -> None:
        """What requests are answered with, from the sentence's token ids (special tokens left
        out): its first `max_output_tokens` (repeated if short), and their text after k tokens."""
        while len(ids) < self.max_output_tokens:
            ids = ids + ids
        self._answer_ids = ids[:self.max_output_tokens]
        self._texts = [tok.decode(self._answer_ids[:k]) for k in range(len(self._answer_ids) + 1)]

    async def shutdown(self) -> None:
        self._running = False
        streams = list(self._streams.values())
        self._streams.clear()
        self.num_aborted += len(streams)
        for _, _, queue, task in streams:   # a reader still iterating gets EngineDead, as from AsyncEngine
            if task is not None:
                task.cancel()
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(EngineDead("engine shut down"))

    async def __aenter__(self) -> InstantEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # -- the model directory's own --------------------------------------------------------------
    def _started(self) -> tuple[Tokenizer, ModelConfig]:
        """The model directory's tokenizer and config, read by `start`."""
        if not self._loaded or self._tokenizer is None or self._model_config is None:
            raise RuntimeError(f"{type(self).__name__} is not started; call `await engine.start()` first")
        return self._tokenizer, self._model_config

    @property
    def tokenizer(self) -> Tokenizer:
        return self._started()[0]

    @property
    def model_config(self) -> ModelConfig:
        return self._started()[1]

    @property
    def max_model_len(self) -> int:
        self._started()
        return self._max_model_len

    @property
    def tenant_weights(self) -> dict[str, float]:
        return dict(self._tenant_weights)

    def purge_tenant(self, tenant: str) -> None:
        """No KV cache here: nothing to drop."""

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant: must be a non-empty string, got {tenant!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"weight: must be a number > 0, got {weight!r}")
        self._tenant_weights[tenant] = float(weight)

    # -- EngineClient ---------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._loaded

    def model_stats(self, model: str) -> EngineStats:
        """An engine of one model: its stats."""
        return self.stats()

    def stats(self) -> EngineStats:
        """Requests count as running while their stream is open; nothing waits, no KV."""
        running = Counter(entry[0] for entry in self._streams.values())
        classes = self.service_classes
        return EngineStats(
            running={c: running.get(c, 0) for c in classes},
            waiting={c: 0 for c in classes},
            waiting_requests={c: 0 for c in classes},
            num_requests=len(self._streams),
            num_generated_tokens=self.num_generated_tokens,
        )

    # -- EngineAdmin: no adapters ------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        raise LoRAError(f"lora_name: {lora_request.lora_name!r}: {self.kind} serves no adapters",
                        field="lora_name")

    def remove_lora(self, name: str) -> bool:
        return False

    def unload_lora(self, name: str) -> bool:
        return False

    @property
    def loras(self) -> dict[str, LoRARequest]:
        return {}

    # -- requests -------------------------------------------------------------------------------
    def generate(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
                 **options: Unpack[SubmitOptions]) -> AsyncIterator[RequestOutput]:
        return self.submit(prompt, sampling_params, request_id, **options).outputs()

    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
               **options: Unpack[SubmitOptions]) -> RequestStream:
        """Nothing queues here, so nothing is ever shed (`sheddable` is ignored)."""
        service_class = options.get("service_class", "online")
        tenant = options.get("tenant", "default")
        self._started()
        tok = self.tokenizer
        text, ids = to_token_ids(tok, prompt)
        check_request(EngineRequest(request_id, ids, sampling_params, prompt=text,
                                    tenant=tenant, service_class=service_class,
                                    priority=options.get("priority", 0), model=options.get("model"),
                                    cache_salt=options.get("cache_salt")),
                      self.model_config.vocab_size, self._max_model_len)
        if len(self._streams) >= self.max_waiting_per_class:
            raise self._overloaded(service_class)
        if not self._running:
            raise EngineDead("engine is not running; call `await engine.start()` first")
        if request_id in self._streams:
            raise InvalidRequest(f"request_id: {request_id!r} is already in the engine", field="request_id")
        if service_class not in self.service_classes:
            raise InvalidRequest(f"service_class: {service_class!r} is not one of {self.service_classes}",
                                 field="service_class")
        queue: asyncio.Queue = asyncio.Queue()
        task = self._feed(queue, self._outputs(request_id, text, ids, sampling_params, tok))
        self._streams[request_id] = (service_class, tenant, queue, task)
        self.num_submitted += 1
        stream = RequestStream(request_id, queue, abort=self._abort_now, forget=self._forget)
        stream.merge_waiting = False        # every token queued at once: one output each, as a step's
        return stream

    def _overloaded(self, service_class: str) -> EngineOverloaded:
        """The refusal of a request while `max_waiting_per_class` are open."""
        return EngineOverloaded(f"service_class {service_class!r}: {self.max_waiting_per_class} "
                                "requests already waiting", service_class=service_class)

    def _feed(self, queue: asyncio.Queue, outputs: Iterable[RequestOutput]) -> asyncio.Task | None:
        """Hand a request's outputs to its stream: here all of them now, with no task. An engine
        that paces them returns the task doing it (cancelled on abort and on shutdown)."""
        for out in outputs:
            queue.put_nowait(out)
        return None

    def _outputs(self, request_id: str, text: str | None, ids: list[int], sp: SamplingParams,
                 tok: Tokenizer) -> Iterable[RequestOutput]:
        """A request's outputs, all made now: the answer's first k tokens."""
        limit = sp.max_tokens if sp.max_tokens is not None else self._max_model_len - len(ids)
        k = max(1, min(limit, self.max_output_tokens, self._max_model_len - len(ids)))
        reason = "length" if k == limit else "stop"
        answer = self._answer_ids[:k]
        now = time.time()
        steps = range(1, k + 1) if self.per_token_outputs else (k,)
        outs: list[RequestOutput] = []
        prev = 0
        for j in steps:
            last = j == k
            lps = None
            if sp.logprobs is not None:
                lps = [self._logprob_entry(t, sp.logprobs, tok) for t in answer[:j]]
            outs.append(self._output(request_id, text, ids, sp.n, answer[:j], self._texts[j],
                                     answer[prev:j], self._texts[j][len(self._texts[prev]):], lps,
                                     reason if last else None, now, now if last else None))
            prev = j
        self.num_generated_tokens += k * sp.n
        return outs

    def _output(self, request_id: str, prompt: str | None, prompt_ids: list[int], n: int,
                token_ids: list[int], text: str, delta_ids: list[int], delta_text: str,
                logprobs: list[dict[int, Logprob]] | None, finish_reason: str | None,
                arrived: float, finished: float | None) -> RequestOutput:
        """One cumulative output, its `n` samples alike: the answer so far (`token_ids`, `text`),
        what this step added (`delta_ids`, `delta_text`), one `logprobs` entry a token (None
        when not asked for), finished when it has a `finish_reason` (and a `finished` time;
        the request was scheduled and had its first token when it `arrived`)."""
        cumulative = -0.25 * len(token_ids) if logprobs is not None else None
        comps = []
        for i in range(n):
            comps.append(CompletionOutput(
                index=i, text=text, token_ids=list(token_ids), cumulative_logprob=cumulative,
                logprobs=list(logprobs) if logprobs is not None else None, finish_reason=finish_reason,
                stop_reason=None, delta_text=delta_text, delta_token_ids=list(delta_ids)))
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids, outputs=comps,
                             finished=finish_reason is not None, num_cached_tokens=0,
                             metrics=RequestMetrics(arrived, arrived, arrived, finished))

    def _logprob_entry(self, token: int, top: int, tok: Tokenizer) -> dict[int, Logprob]:
        entry = {token: Logprob(-0.25, 1, tok.decode([token], skip_special_tokens=False))}
        alt = self.logprob_alternatives_from
        while len(entry) < top + 1 and alt < self.model_config.vocab_size:
            if alt != token:
                entry[alt] = Logprob(-3.0 - alt * 1e-3, len(entry) + 1,
                                     tok.decode([alt], skip_special_tokens=False))
            alt += 1
        return entry

    # the stream's hooks
    def _forget(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.num_finished += 1

    def _abort_now(self, request_id: str) -> None:
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            if entry[3] is not None:
                entry[3].cancel()
            self.num_aborted += 1

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)
