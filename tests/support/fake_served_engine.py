"""`FakeServedEngine`: an engine a gateway can serve (engine/client.py's `ModelEngine`, as
`AsyncEngine` is) that runs no model, for the tests of the gateway's routes: validation,
auth, errors, response shapes, streaming, usage rows, limits. Tests of what a model writes
(greedy tokens, logprobs, structured outputs, adapters) use the real engine.

    app = create_app(settings, engine_factory=FakeServedEngine.factory(made))   # made: a list
    ...
    made[0].num_aborted          # what the gateway did to it

What it answers: the model directory is real (its tokenizer and context length), the
output is not. Each sample is the tokens of a fixed sentence, repeated: `max_tokens` of
them ("length"), except that without `ignore_eos` the answer ends ("stop") after
`eos_after` tokens, as a model's end-of-sequence would; and never past the context.
Outputs are cumulative, one per token, `token_interval_s` apart (0: one per turn of the
event loop, as an engine's steps are, so that a client leaving mid-stream is seen while
the answer is still running; a test may change it on a running engine); with `logprobs`,
fixed values of the right shape. Stop strings, seeds, penalties and constraints are
accepted and ignored.

It refuses what `AsyncEngine` refuses before queueing anything: a prompt empty, outside the
vocabulary or filling the context (InvalidRequest / PromptTooLong), an unknown service
class or a duplicate request id (InvalidRequest), more than `max_waiting` open requests
(EngineOverloaded), and anything before `start()` or after `shutdown()` (EngineDead).
Adapters: none (`add_lora` raises LoRAError).

Several models on one "shared engine" (the gateway's `shared_engine`, the factory called
with `models=`): a `FakeEnginePool`, one FakeServedEngine per model, each bound by
`for_model(name)`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

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
    ModelBinding,
    ModelConfig,
    ModelEngine,
    Prompt,
    PromptTooLong,
    RequestMetrics,
    RequestOutput,
    RequestStream,
    SamplingParams,
    Tokenizer,
)

SENTENCE = (" The quick brown fox jumps over the lazy dog, and the gateway answers every"
            " request at once so that only its own behaviour is left to test.")
CLASSES = ("priority", "online", "offline")


class FakeServedEngine(ModelEngine):
    def __init__(self, model: str | Path, *, eos_after: int = 64, token_interval_s: float = 0.0,
                 max_model_len: int | None = None, max_waiting: int = 100_000,
                 service_classes: tuple[str, ...] = CLASSES, **ignored: Any) -> None:
        """`ignored`: AsyncEngine's other keyword arguments (kv_cache_memory, enable_lora...),
        accepted so that the same settings build either engine."""
        model = Path(model)
        if not model.is_dir():
            raise ValueError(f"model must be a model directory; {str(model)!r} is not one")
        self.model_dir = model
        self.eos_after = eos_after
        self.token_interval_s = token_interval_s
        self.max_waiting = max_waiting
        self.service_classes = tuple(service_classes)
        self.ignored_kwargs = dict(ignored)
        self._max_model_len_setting = max_model_len
        self._loaded = False
        self._running = False
        self._tokenizer: Tokenizer | None = None
        self._vocab_size = 0
        self.max_model_len = 0
        self._answer: list[int] = []
        self._pieces: list[str] = []                # the text of each answer token
        self._open: dict[str, tuple[str, str, asyncio.Queue, asyncio.Task | None]] = {}
        self._tenant_weights: dict[str, float] = {}
        # what the gateway did, for tests
        self.submitted: list[tuple[str, SamplingParams, dict[str, Any]]] = []
        self.num_finished = 0
        self.num_aborted = 0
        self.num_refused = 0
        self.num_generated_tokens = 0

    @classmethod
    def factory(cls, made: list | None = None, **defaults: Any) -> Callable[..., Any]:
        """An `engine_factory` for `create_app`: (model_dir, **engine_kwargs) -> an engine, or a
        FakeEnginePool when called with `models=` (the gateway's shared engine). Each engine
        made is appended to `made`; `defaults` are keyword arguments the settings' own win over."""
        def make(model_dir: str, *, served_model_name: str | None = None, models: dict | None = None,
                 memory_budget: int | None = None, **kwargs: Any) -> Any:
            kwargs = {**defaults, **kwargs}
            if models:
                dirs = {served_model_name or Path(model_dir).name: model_dir, **models}
                engines = {name: cls(path, **kwargs) for name, path in dirs.items()}
                if made is not None:
                    made.extend(engines.values())
                return FakeEnginePool(engines)
            engine = cls(model_dir, **kwargs)
            if made is not None:
                made.append(engine)
            return engine
        return make

    # -- life cycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if not self._loaded:
            await asyncio.to_thread(self._load)
            self._loaded = True
        self._running = True

    def _load(self) -> None:
        config = ModelConfig.from_dir(self.model_dir)
        tok = Tokenizer(self.model_dir)
        special = tok.special_token_ids | set(config.eos_token_ids)
        ids = [t for t in tok.encode(SENTENCE, add_special_tokens=False) if t not in special]
        pieces = [tok.decode([t]) for t in ids]
        if "".join(pieces) != tok.decode(ids) or tok.decode(ids + ids) != tok.decode(ids) * 2:
            raise RuntimeError(f"{self.model_dir}: the sentence does not decode token by token")
        self._answer, self._pieces = ids, pieces
        self._tokenizer, self._vocab_size = tok, config.vocab_size
        self.max_model_len = config.context_length(self._max_model_len_setting)

    async def shutdown(self) -> None:
        self._running = False
        for request_id in list(self._open):
            _, _, queue, task = self._open.pop(request_id)
            if task is not None:
                task.cancel()
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(EngineDead("engine shut down"))
            self.num_aborted += 1

    @property
    def is_ready(self) -> bool:
        return self._loaded and self._running

    # -- tenants, adapters ----------------------------------------------------------------------------
    @property
    def tenant_weights(self) -> dict[str, float]:
        return dict(self._tenant_weights)

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant: must be a non-empty string, got {tenant!r}")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"weight: must be a number > 0, got {weight!r}")
        self._tenant_weights[tenant] = float(weight)

    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        raise LoRAError(f"lora_name: {lora_request.lora_name!r}: the fake engine serves no adapters",
                        field="lora_name")

    def remove_lora(self, name: str) -> bool:
        return False

    def unload_lora(self, name: str) -> bool:
        return False

    @property
    def loras(self) -> dict[str, LoRARequest]:
        return {}

    # -- stats ------------------------------------------------------------------------------------------
    def model_stats(self, model: str) -> EngineStats:
        """An engine of one model: its stats (the gateway binds it with `ModelBinding`)."""
        return self.stats()

    def stats(self) -> EngineStats:
        """Every open request counts as running (nothing waits, no KV is used)."""
        running = Counter(cls for cls, _, _, _ in self._open.values())
        by_tenant = Counter(tenant for _, tenant, _, _ in self._open.values())
        return EngineStats(
            running={c: running.get(c, 0) for c in self.service_classes},
            waiting=dict.fromkeys(self.service_classes, 0),
            waiting_requests=dict.fromkeys(self.service_classes, 0),
            running_by_tenant=dict(by_tenant),
            num_requests=len(self._open),
            num_generated_tokens=self.num_generated_tokens,
        )

    @property
    def open_requests(self) -> int:
        return len(self._open)

    # -- requests ---------------------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        tenant: str = "default",
        service_class: str = "online",
        priority: int = 0,
        model: str | None = None,
        cache_salt: str | None = None,
        sheddable: bool = True,
    ) -> RequestStream:
        if not self._loaded or not self._running:
            raise EngineDead("engine is not running; call `await engine.start()` first")
        text, ids = self._token_ids(prompt)
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id: must be a non-empty string", field="request_id")
        if request_id in self._open:
            raise InvalidRequest(f"request_id: {request_id!r} is already in the engine", field="request_id")
        if service_class not in self.service_classes:
            raise InvalidRequest(f"service_class: {service_class!r} is not one of {self.service_classes}",
                                 field="service_class")
        if not ids:
            raise InvalidRequest("prompt: must not be empty", field="prompt")
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self._vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt_token_ids: token id {bad!r} is outside the vocabulary "
                                 f"[0, {self._vocab_size})", field="prompt_token_ids")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt: {len(ids)} tokens leave no room for output within "
                                f"max_model_len {self.max_model_len}")
        if len(self._open) >= self.max_waiting:
            self.num_refused += 1
            raise EngineOverloaded(f"service_class {service_class!r}: {self.max_waiting} requests "
                                   "already in the engine", service_class=service_class)
        self.submitted.append((request_id, sampling_params, {
            "tenant": tenant, "service_class": service_class, "priority": priority, "model": model,
            "cache_salt": cache_salt, "sheddable": sheddable}))
        queue: asyncio.Queue = asyncio.Queue()
        outputs = self._outputs(request_id, text, ids, sampling_params)
        task = asyncio.get_running_loop().create_task(self._feed(queue, outputs))
        self._open[request_id] = (service_class, tenant, queue, task)
        return RequestStream(request_id, queue, abort=self._abort_now, forget=self._forget)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        stream = self.submit(prompt, sampling_params, request_id, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def _token_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        assert self._tokenizer is not None
        if isinstance(prompt, str):
            return prompt, self._tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._tokenizer.encode(prompt["prompt"])
            raise InvalidRequest("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'", field="prompt")
        if isinstance(prompt, list):
            return None, list(prompt)
        raise InvalidRequest(f"prompt: expected a string or a dict, got {type(prompt).__name__}",
                             field="prompt")

    def _outputs(self, request_id: str, text: str | None, ids: list[int],
                 sp: SamplingParams) -> Iterator[RequestOutput]:
        """The request's outputs, made one at a time (a long answer is never all in memory)."""
        room = self.max_model_len - len(ids)
        limit = room if sp.max_tokens is None else min(sp.max_tokens, room)
        k = limit if sp.ignore_eos else min(limit, self.eos_after)
        k = max(k, 1)
        reason = "length" if k == limit else "stop"
        period = len(self._answer)
        answer = [self._answer[i % period] for i in range(k)]
        pieces = [self._pieces[i % period] for i in range(k)]
        now = time.time()
        texts = [""] * sp.n
        lps: list[dict[int, Logprob]] = []
        for j in range(1, k + 1):
            last = j == k
            if sp.logprobs is not None:
                lps.append(self._logprobs(answer[j - 1], sp.logprobs))
            comps = []
            for i in range(sp.n):
                texts[i] += pieces[j - 1]
                comps.append(CompletionOutput(
                    index=i, text=texts[i], token_ids=answer[:j],
                    cumulative_logprob=-0.25 * j if sp.logprobs is not None else None,
                    logprobs=list(lps) if sp.logprobs is not None else None,
                    finish_reason=reason if last else None, stop_reason=None,
                    delta_text=pieces[j - 1], delta_token_ids=[answer[j - 1]]))
            self.num_generated_tokens += sp.n
            yield RequestOutput(
                request_id=request_id, prompt=text, prompt_token_ids=list(ids), outputs=comps,
                finished=last, num_cached_tokens=0,
                metrics=RequestMetrics(now, now, now, time.time() if last else None))

    def _logprobs(self, token: int, top: int) -> dict[int, Logprob]:
        assert self._tokenizer is not None
        entry = {token: Logprob(-0.25, 1, self._tokenizer.decode([token], skip_special_tokens=False))}
        alt = 3
        while len(entry) < top + 1 and alt < self._vocab_size:
            if alt != token:
                entry[alt] = Logprob(-3.0 - alt * 1e-3, len(entry) + 1,
                                     self._tokenizer.decode([alt], skip_special_tokens=False))
            alt += 1
        return entry

    async def _feed(self, queue: asyncio.Queue, outputs: Iterator[RequestOutput]) -> None:
        for out in outputs:
            await asyncio.sleep(self.token_interval_s)
            queue.put_nowait(out)

    # the stream's hooks
    def _forget(self, request_id: str) -> None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            self.num_finished += 1

    def _abort_now(self, request_id: str) -> None:
        entry = self._open.pop(request_id, None)
        if entry is not None:
            if entry[3] is not None:
                entry[3].cancel()
            self.num_aborted += 1


class FakeEnginePool:
    """Several FakeServedEngines behind one object, as the gateway's shared engine (an
    AsyncEngine with `models=`) is: started and stopped together, `for_model(name)` each."""

    def __init__(self, engines: dict[str, FakeServedEngine]) -> None:
        self.engines = engines

    async def start(self) -> None:
        for engine in self.engines.values():
            await engine.start()

    async def shutdown(self) -> None:
        for engine in self.engines.values():
            await engine.shutdown()

    def for_model(self, name: str) -> ModelBinding:
        return ModelBinding(self.engines[name], name)
