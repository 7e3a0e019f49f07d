"""Structured outputs: grammars that constrain decoding, through llguidance.

A request's `StructuredOutputsParams` (a JSON schema, any JSON object, a regex, a choice of
strings) is compiled once per tokenizer and spec by a `GrammarCompiler`: a cache of futures
bounded in bytes and per tenant (engine/grammar_cache.py), compiled on a small thread pool,
never on the step loop, each with its first mask computed there too and its cost bounded
(engine/grammar_limits.py); the gateway awaits the same future to refuse a bad, slow or
too complex spec before it reaches the engine. In the engine, a `GrammarManager` gives each
sequence its own matcher (a copy of the compiled one, its first mask computed) once the
compile is done; a waiting request is not scheduled before then. Each step, the sampler
masks every constrained row's logits to the tokens its matcher allows (`grammar_bitmask`,
`mask_logits`; each row's CPU time counted against a budget), so constrained and free
rows share one step and one sampling pass (on an accelerator the runner computes the masks
on a thread while the forward runs); the output processor feeds each sampled token to its
matcher and ends the sequence ("stop") once the grammar is complete. The end-of-sequence
token is allowed only where the grammar is complete.

JSON is compact (no whitespace between tokens) and bounded where the schema is: `enum`,
`const`, `maxLength`, `maxItems`, integer `minimum`/`maximum` and `additionalProperties:
false` leave a finite language, so even a weak model reaches its end.

llguidance rather than xgrammar: both compile JSON schemas with their bounds, but xgrammar
0.2.9 requires triton on Linux x86-64 (large, unused on the CPU) and apache-tvm-ffi, while
llguidance is one wheel with no dependencies. Its torch helper compiles the masking kernel
with `torch.compile` (a C++ toolchain on first use on the CPU), so the bitmask is unpacked
here, with numpy.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import numpy as np
import torch

from lockgate.engine.errors import GrammarError
from lockgate.engine.grammar_cache import GrammarCache, charge
from lockgate.engine.grammar_limits import MAX_ERROR_CHARS, check_expansion, parser_limits, probe, timed_masks
from lockgate.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from lockgate.engine.request import RequestState, Sequence

logger = logging.getLogger(__name__)

# compact JSON: no free whitespace (the schema's own "x-guidance" options may say otherwise)
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# the cache: its bytes are estimates (engine/grammar_cache.py); a tenant's share is a quarter
CACHE_BYTES = 256 << 20
CACHE_ENTRIES = 512
TENANT_SHARE = 0.25


@dataclass(slots=True, frozen=True)
class CompiledGrammar:
    """A grammar ready to run: a matcher at its start, copied for each sequence."""

    matcher: llguidance.LLMatcher
    seconds: float              # how long compiling took (the gateway refuses slow ones)
    first_mask_s: float = 0.0   # the first mask's CPU time (computed at compile, kept in `matcher`)
    grammar_chars: int = 0      # the llguidance grammar's length (the cache charges by it)

    def new_matcher(self) -> llguidance.LLMatcher:
        return self.matcher.deep_copy()


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (not yet checked: compiling does that)."""
    kind, text = spec.key()
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        # a choice: Lark's string literals take JSON's escapes
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice or []))
    except (ValueError, TypeError, RuntimeError) as exc:    # not JSON, or not a schema object
        raise GrammarError(f"structured_outputs.{kind}: {exc}", field=f"structured_outputs.{kind}") from None


class GrammarCompiler:
    """Compiles specs for one tokenizer, each once: `compile` returns the spec's future (a
    cached one when the same spec was asked for before, done or still compiling). Failures
    are cached too (the same bad schema fails at once). `owner` is the tenant a new entry
    is charged to (engine/grammar_cache.py). The tokenizer's token table is built on first
    use, on the pool."""

    def __init__(self, tokenizer_json: str | Path, vocab_size: int, eos_token_ids: list[int], *,
                 max_entries: int = CACHE_ENTRIES, max_bytes: int = CACHE_BYTES,
                 tenant_share: float = TENANT_SHARE, num_threads: int = 2) -> None:
        self.tokenizer_json = str(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache: GrammarCache[CompiledGrammar] = GrammarCache(max_bytes, max_entries, tenant_share)
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="lockgate-grammar")
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()

    @property
    def max_bytes(self) -> int:
        return self.cache.max_bytes

    @property
    def tenant_share(self) -> float:
        return self.cache.tenant_share

    @property
    def total_bytes(self) -> int:
        return self.cache.total_bytes

    def bytes_of(self, owner: str) -> int:
        return self.cache.bytes_of(owner)

    def num_entries(self, owner: str | None = None) -> int:
        return self.cache.num_entries(owner)

    def compile(self, spec: StructuredOutputsParams, owner: str = "default") -> Future[CompiledGrammar]:
        key = spec.key()
        future, new = self.cache.get_or_start(key, lambda: self._pool.submit(self._build, spec), owner,
                                              charge(len(key[1])))
        if new:     # outside the cache's lock: a future already done calls back at once
            future.add_done_callback(lambda f: self.cache.recharge(key, f, self._charge(f, len(key[1]))))
        return future

    @staticmethod
    def _charge(future: Future[CompiledGrammar], spec_chars: int) -> int:
        if future.cancelled() or future.exception() is not None:
            return charge(spec_chars)
        compiled = future.result()
        return charge(compiled.grammar_chars, compiled.first_mask_s)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids)
            return self._tokenizer

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        t0 = time.perf_counter()
        kind, text = spec.key()
        check_expansion(kind, text)
        tokenizer = self.tokenizer()
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
        refusal: GrammarError | None = None
        first_mask_s = 0.0
        if matcher.is_error():
            refusal = GrammarError(f"structured_outputs.{kind}: {matcher.get_error()[:MAX_ERROR_CHARS]}",
                                   field=f"structured_outputs.{kind}")
        else:
            first_mask_s, refusal = probe(matcher, self.vocab_size, kind)
        if refusal is not None:
            del matcher     # not kept by the traceback of the failure the cache keeps
            raise refusal
        return CompiledGrammar(matcher, time.perf_counter() - t0, first_mask_s, len(grammar))


@cache
def _compiler(tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarCompiler:
    return GrammarCompiler(tokenizer_json, vocab_size, list(eos_token_ids))


def grammar_compiler(model_dir: str | Path, vocab_size: int, eos_token_ids: list[int]) -> GrammarCompiler:
    """The process's compiler for a model directory's tokenizer: one cache shared by the
    gateway's checks and an engine in the same process."""
    path = (Path(model_dir) / "tokenizer.json").resolve()
    return _compiler(str(path), vocab_size, tuple(eos_token_ids))


class GrammarManager:
    """One model's constrained requests: their grammars while compiling, each sequence's
    matcher once compiled, and the requests whose spec failed (`take_failures`: the core
    fails them)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._pending: dict[str, tuple[RequestState, Future[CompiledGrammar]]] = {}
        self._failures: list[tuple[RequestState, GrammarError]] = []

    @property
    def num_pending(self) -> int:
        """Requests whose grammar is compiling or failed, not yet taken."""
        return len(self._pending) + len(self._failures)

    def add(self, state: RequestState) -> None:
        spec = state.req.sampling.structured_outputs
        if spec is not None:
            self._pending[state.request_id] = (state, self.compiler.compile(spec, state.req.tenant))
            self._bind(state.request_id)

    def is_ready(self, seq: Sequence) -> bool:
        """May `seq` be scheduled? Yes when unconstrained or its matcher is bound."""
        if seq.grammar is not None or seq.params.structured_outputs is None:
            return True
        return self._bind(seq.state.request_id)

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def take_failures(self) -> list[tuple[RequestState, GrammarError]]:
        failures, self._failures = self._failures, []
        return failures

    def _bind(self, request_id: str) -> bool:
        entry = self._pending.get(request_id)
        if entry is None or not entry[1].done():
            return False
        state, future = self._pending.pop(request_id)
        try:
            compiled = future.result()
        except GrammarError as exc:
            self._failures.append((state, exc))
            return False
        except Exception as exc:  # a compiler bug fails its request, not the loop
            logger.exception("grammar compile of %s failed", request_id)
            self._failures.append((state, GrammarError(f"structured_outputs: could not compile: {exc!r}")))
            return False
        for seq in state.seqs:
            seq.grammar = compiled.new_matcher()
        return True


# -- masking -------------------------------------------------------------------------------------


def grammar_bitmask(matchers: list[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """The tokens each matcher allows next: one row of int32 words per matcher, token t is
    bit t % 32 of word t // 32 (llguidance's layout, written in place)."""
    mask = torch.zeros((len(matchers), (vocab_size + 31) // 32), dtype=torch.int32)
    timed_masks(matchers, mask)
    return mask


def _unpack(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    # little-endian int32 words as bytes, each byte's bits lowest first: token order
    bits = np.unpackbits(words.view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(np.bool_))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask unpacked: bool [rows, vocab_size], True where allowed. (numpy's
    `unpackbits`: one C pass over the bytes, where shifts and masks in torch make a whole
    tensor per op.)"""
    return _unpack(np.ascontiguousarray(bitmask.numpy()), vocab_size)


def refused_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [rows, vocab_size], True where the bitmask refuses the token."""
    return _unpack(np.invert(bitmask.numpy()), vocab_size)


def mask_logits(logits: torch.Tensor, row_ids: list[int], bitmask: torch.Tensor) -> None:
    """In place: the rows `row_ids` of `logits` keep only the tokens `bitmask` (one row each,
    from `grammar_bitmask`) allows."""
    refused = refused_tokens(bitmask, logits.shape[-1]).to(logits.device, non_blocking=True)
    if len(row_ids) == logits.shape[0]:
        logits.masked_fill_(refused, float("-inf"))
        return
    idx = torch.tensor(row_ids, device=logits.device)
    logits[idx] = logits[idx].masked_fill(refused, float("-inf"))
