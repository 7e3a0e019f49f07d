"""`FakeServedEngine`: an engine a gateway can serve (engine/client.py's `ModelEngine`, as
`AsyncEngine` is) that runs no model, for the tests of the gateway's routes: validation,
auth, errors, response shapes, streaming, usage rows, limits. Tests of what a model writes
(greedy tokens, logprobs, structured outputs, adapters) use the real engine.

    app = create_app(settings, engine_factory=FakeServedEngine.factory(made))   # made: a list
    ...
    made[0].num_aborted          # what the gateway did to it

It is the benchmark's `InstantEngine` (loadtests/instant_engine.py) made to behave like a
model being served: it inherits the life cycle, the model directory's tokenizer and context
length, tenant weights, adapters (none: `add_lora` raises LoRAError), stats and the checks
of `submit`, and overrides what the answer is and how it is fed. A test may script the next
answers (`answers`: texts, in order) where what the model writes matters (a tool call).

What it answers: the model directory is real (its tokenizer and context length), the
output is not. Each sample is the tokens of a fixed sentence, repeated: `max_tokens` of
them ("length"), except that without `ignore_eos` the answer ends ("stop") after
`eos_after` tokens, as a model's end-of-sequence would; and never past the context.
Outputs are cumulative, one per token, `token_interval_s` apart (0: one per turn of the
event loop, as an engine's steps are, so that a client leaving mid-stream is seen while
the answer is still running; a test may change it on a running engine), made as they are
fed (a long answer is never all in memory); with `logprobs`, fixed values of the right
shape. Stop strings, seeds, penalties and constraints are accepted and ignored.

It refuses what `AsyncEngine` refuses before queueing anything: a prompt empty, outside the
vocabulary or filling the context, bad sampling parameters or options (InvalidRequest /
PromptTooLong), an unknown service class or a duplicate request id (InvalidRequest), more
than `max_waiting` open requests (EngineOverloaded, counted in `num_refused`), and anything
before `start()` or after `shutdown()` (EngineDead). What the gateway did: `submitted`
(each request accepted, its sampling parameters and options), `num_finished`,
`num_aborted`, `num_refused`, `open_requests`.

Several models on one "shared engine" (the gateway's `shared_engine`, the factory called
with `models=`): a `FakeEnginePool`, one FakeServedEngine per model, each bound by
`for_model(name)`.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Unpack

from lockgate.engine import (
    CompletionOutput,
    EngineDead,
    EngineOverloaded,
    EngineStats,
    Logprob,
    ModelBinding,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    Tokenizer,
)
from lockgate.engine.client import Prompt, RequestStream, SubmitOptions
from lockgate.loadtests.instant_engine import InstantEngine

SENTENCE = (" The quick brown fox jumps over the lazy dog, and the gateway answers every"
            " request at once so that only its own behaviour is left to test.")
CLASSES = ("priority", "online", "offline")
# what `submitted` records of a request's options: each of them, AsyncEngine's default if not given
OPTION_DEFAULTS: SubmitOptions = {"tenant": "default", "service_class": "online", "priority": 0,
                                  "model": None, "cache_salt": None, "sheddable": True,
                                  "cache_hint": None}


class FakeServedEngine(InstantEngine):
    sentence = SENTENCE
    kind = "the fake engine"
    logprob_alternatives_from = 3

    def __init__(self, model: str | Path, *, eos_after: int = 64, token_interval_s: float = 0.0,
                 max_model_len: int | None = None, max_waiting: int = 100_000,
                 service_classes: tuple[str, ...] = CLASSES, **ignored: Any) -> None:
        """`ignored`: AsyncEngine's other keyword arguments (kv_cache_memory, enable_lora...),
        accepted so that the same settings build either engine."""
        super().__init__(model, max_model_len=max_model_len, max_waiting_per_class=max_waiting,
                         service_classes=service_classes)
        self.ignored_kwargs = dict(ignored)
        self.eos_after = eos_after
        self.token_interval_s = token_interval_s
        self._pieces: list[str] = []                # the text of each answer token
        # what the gateway did, for tests (InstantEngine counts num_finished, num_aborted...)
        self.submitted: list[tuple[str, SamplingParams, dict[str, Any]]] = []
        self.num_refused = 0
        # a test's hook: the next requests' answers, in order (a tool call's JSON, say): each
        # its text's tokens, "stop" at its end ("length" if max_tokens cuts it first); a list of
        # texts answers each of `n` samples with its own, so that they end at different steps
        self.answers: list[str | list[str]] = []

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

    @property
    def max_waiting(self) -> int:
        """The most requests open at once (InstantEngine's `max_waiting_per_class`)."""
        return self.max_waiting_per_class

    @max_waiting.setter
    def max_waiting(self, value: int) -> None:
        self.max_waiting_per_class = value

    def _set_answer(self, tok: Tokenizer, ids: list[int]) -> None:
        """The whole sentence, repeated as long as an answer runs: so its text must be that of
        its tokens one by one."""
        pieces = [tok.decode([t]) for t in ids]
        if "".join(pieces) != tok.decode(ids) or tok.decode(ids + ids) != tok.decode(ids) * 2:
            raise RuntimeError(f"{self.model_dir}: the sentence does not decode token by token")
        self._answer_ids, self._pieces = ids, pieces

    @property
    def is_ready(self) -> bool:
        """Started and not shut down (InstantEngine stays ready once loaded)."""
        return self._loaded and self._running

    def stats(self) -> EngineStats:
        """InstantEngine's, and each tenant's open requests."""
        stats = super().stats()
        stats.running_by_tenant = dict(Counter(entry[1] for entry in self._streams.values()))
        return stats

    @property
    def open_requests(self) -> int:
        return len(self._streams)

    # -- requests ---------------------------------------------------------------------------------------
    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
               **options: Unpack[SubmitOptions]) -> RequestStream:
        """InstantEngine's checks (EngineDead before `start()` too), the request recorded."""
        if not self._loaded or not self._running:
            raise EngineDead("engine is not running; call `await engine.start()` first")
        stream = super().submit(prompt, sampling_params, request_id, **options)
        recorded = {key: options.get(key, default) for key, default in OPTION_DEFAULTS.items()}
        self.submitted.append((request_id, sampling_params, recorded))
        return stream

    def _overloaded(self, service_class: str) -> EngineOverloaded:
        self.num_refused += 1
        return EngineOverloaded(f"service_class {service_class!r}: {self.max_waiting} requests "
                                "already in the engine", service_class=service_class)

    def _outputs(self, request_id: str, text: str | None, ids: list[int], sp: SamplingParams,
                 tok: Tokenizer) -> Iterator[RequestOutput]:
        """The request's outputs, made one at a time as they are fed."""
        room = self._max_model_len - len(ids)
        limit = room if sp.max_tokens is None else min(sp.max_tokens, room)
        if self.answers:
            script = self.answers.pop(0)
            if isinstance(script, list):
                yield from self._scripted_samples(request_id, text, ids, sp, tok, script, limit)
            else:
                yield from self._scripted(request_id, text, ids, sp, tok, script, limit)
            return
        k = limit if sp.ignore_eos else min(limit, self.eos_after)
        k = max(k, 1)
        reason = "length" if k == limit else "stop"
        period = len(self._answer_ids)
        answer = [self._answer_ids[i % period] for i in range(k)]
        now = time.time()
        so_far = ""
        lps: list[dict[int, Logprob]] = []
        for j in range(1, k + 1):
            last = j == k
            piece = self._pieces[(j - 1) % period]
            so_far += piece
            if sp.logprobs is not None:
                lps.append(self._logprob_entry(answer[j - 1], sp.logprobs, tok))
            self.num_generated_tokens += sp.n
            yield self._output(request_id, text, list(ids), sp.n, answer[:j], so_far, answer[j - 1:j], piece,
                               lps if sp.logprobs is not None else None, reason if last else None,
                               now, time.time() if last else None)

    def _scripted(self, request_id: str, text: str | None, ids: list[int], sp: SamplingParams,
                  tok: Tokenizer, answer_text: str, limit: int) -> Iterator[RequestOutput]:
        """`answer_text`'s tokens, one output each, the text decoded as it grows."""
        answer = tok.encode(answer_text, add_special_tokens=False)
        k = max(1, min(len(answer), limit))
        reason = "stop" if k == len(answer) else "length"
        now = time.time()
        so_far = ""
        for j in range(1, k + 1):
            whole = tok.decode(answer[:j])
            piece, so_far = whole[len(so_far):], whole
            self.num_generated_tokens += sp.n
            yield self._output(request_id, text, list(ids), sp.n, answer[:j], so_far, answer[j - 1:j], piece,
                               None, reason if j == k else None, now, time.time() if j == k else None)

    def _scripted_samples(self, request_id: str, text: str | None, ids: list[int], sp: SamplingParams,
                          tok: Tokenizer, texts: list[str], limit: int) -> Iterator[RequestOutput]:
        """Each sample its own text (`texts[i]`, the last one for samples past the list): one
        token a step each, a sample that has ended staying in later outputs with its finish
        reason and nothing new, as the engine's cumulative outputs keep it."""
        answers = [tok.encode(texts[min(i, len(texts) - 1)], add_special_tokens=False) for i in range(sp.n)]
        ends = [max(1, min(len(a), limit)) for a in answers]
        now = time.time()
        for j in range(1, max(ends) + 1):
            comps = []
            for i, answer in enumerate(answers):
                k = min(j, ends[i])
                whole, before = tok.decode(answer[:k]), tok.decode(answer[:k - 1]) if j <= ends[i] else None
                reason = ("stop" if ends[i] == len(answer) else "length") if k == ends[i] else None
                comps.append(CompletionOutput(
                    index=i, text=whole, token_ids=answer[:k], cumulative_logprob=None, logprobs=None,
                    finish_reason=reason, stop_reason=None,
                    delta_text=whole[len(before):] if before is not None else "",
                    delta_token_ids=answer[k - 1:k] if j <= ends[i] else []))
                self.num_generated_tokens += int(j <= ends[i])
            last = j == max(ends)
            yield RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=list(ids), outputs=comps,
                                finished=last, num_cached_tokens=0,
                                metrics=RequestMetrics(now, now, now, time.time() if last else None))

    def _feed(self, queue: asyncio.Queue, outputs: Iterable[RequestOutput]) -> asyncio.Task:
        """A task handing the outputs over `token_interval_s` apart (read each time: a test may
        change it while the answer runs)."""
        return asyncio.get_running_loop().create_task(self._pace(queue, outputs))

    async def _pace(self, queue: asyncio.Queue, outputs: Iterable[RequestOutput]) -> None:
        for out in outputs:
            await asyncio.sleep(self.token_interval_s)
            queue.put_nowait(out)


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
