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
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
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
        self._streams: dict[str, tuple[str, asyncio.Queue]] = {}  # open id -> (class, queue)
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
        ids = tok.encode(SENTENCE, add_special_tokens=False)
        special = tok.special_token_ids | set(mc.eos_token_ids)
        ids = [t for t in ids if t not in special]
        while len(ids) < self.max_output_tokens:
            ids = ids + ids
        self._answer_ids = ids[:self.max_output_tokens]
        self._texts = [tok.decode(self._answer_ids[:k]) for k in range(len(self._answer_ids) + 1)]
        self._tokenizer, self._model_config = tok, mc

    async def shutdown(self) -> None:
        self._running = False
        streams = list(self._streams.values())
        self._streams.clear()
        self.num_aborted += len(streams)
        for _, queue in streams:     # a reader still iterating gets EngineDead, as from AsyncEngine
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
            raise RuntimeError("InstantEngine is not started; call `await engine.start()` first")
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
        running = Counter(cls for cls, _ in self._streams.values())
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
        raise LoRAError(f"lora_name: {lora_request.lora_name!r}: the instant engine serves no adapters",
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
        self._started()
        tok = self.tokenizer
        text, ids = to_token_ids(tok, prompt)
        check_request(EngineRequest(request_id, ids, sampling_params, prompt=text,
                                    tenant=options.get("tenant", "default"), service_class=service_class,
                                    priority=options.get("priority", 0), model=options.get("model"),
                                    cache_salt=options.get("cache_salt")),
                      self.model_config.vocab_size, self._max_model_len)
        if len(self._streams) >= self.max_waiting_per_class:
            raise EngineOverloaded(f"service_class {service_class!r}: {self.max_waiting_per_class} "
                                   "requests already waiting", service_class=service_class)
        if not self._running:
            raise EngineDead("engine is not running; call `await engine.start()` first")
        if request_id in self._streams:
            raise InvalidRequest(f"request_id: {request_id!r} is already in the engine", field="request_id")
        if service_class not in self.service_classes:
            raise InvalidRequest(f"service_class: {service_class!r} is not one of {self.service_classes}",
                                 field="service_class")
        queue: asyncio.Queue = asyncio.Queue()
        for out in self._outputs(request_id, text, ids, sampling_params, tok):
            queue.put_nowait(out)
        self._streams[request_id] = (service_class, queue)
        self.num_submitted += 1
        return RequestStream(request_id, queue, abort=self._abort_now, forget=self._forget)

    def _outputs(self, request_id: str, text: str | None, ids: list[int], sp: SamplingParams,
                 tok: Tokenizer) -> list[RequestOutput]:
        limit = sp.max_tokens if sp.max_tokens is not None else self._max_model_len - len(ids)
        k = max(1, min(limit, self.max_output_tokens, self._max_model_len - len(ids)))
        reason = "length" if k == limit else "stop"
        answer = self._answer_ids[:k]
        now = time.time()
        metrics = RequestMetrics(arrival_time=now, first_scheduled_time=now, first_token_time=now,
                                 finished_time=now)
        steps = range(1, k + 1) if self.per_token_outputs else (k,)
        outs: list[RequestOutput] = []
        prev = 0
        for j in steps:
            last = j == k
            comps = []
            for i in range(sp.n):
                lps = None
                if sp.logprobs is not None:
                    lps = [self._logprob_entry(t, sp.logprobs, tok) for t in answer[:j]]
                comps.append(CompletionOutput(
                    index=i, text=self._texts[j], token_ids=list(answer[:j]),
                    cumulative_logprob=-0.25 * j if sp.logprobs is not None else None,
                    logprobs=lps, finish_reason=reason if last else None,
                    stop_reason=None, delta_text=self._texts[j][len(self._texts[prev]):],
                    delta_token_ids=list(answer[prev:j]),
                ))
            outs.append(RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids,
                                      outputs=comps, finished=last, num_cached_tokens=0,
                                      metrics=metrics if last else RequestMetrics(
                                          now, now, now, None)))
            prev = j
        self.num_generated_tokens += k * sp.n
        return outs

    def _logprob_entry(self, token: int, top: int, tok: Tokenizer) -> dict[int, Logprob]:
        entry = {token: Logprob(-0.25, 1, tok.decode([token], skip_special_tokens=False))}
        alt = 0
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
        if self._streams.pop(request_id, None) is not None:
            self.num_aborted += 1

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)
