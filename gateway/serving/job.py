"""`Job`: a parsed inference request ready to run (what it hands the engine, how its
choices and its stream are built), and `RunInputs`, what a run hands the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lockgate.engine import RequestOutput, SamplingParams
from lockgate.gateway.model_directory import ModelEntry
from lockgate.gateway.responses import Head, Kind, answer, head
from lockgate.gateway.settings import Settings
from lockgate.gateway.tokenize_pool import TokenizePool

if TYPE_CHECKING:
    from lockgate.gateway.serving.run import RequestRun


@dataclass(slots=True)
class RunInputs:
    """What a run hands the engine: a prompt's token ids and sampling parameters each, the
    tokens to reserve (prompts + every completion's max_tokens), the request's own cache
    salt and priority, and its `prompt_cache_key` (a routing hint, `cache_hint` to the engine)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    reserve_tokens: int
    cache_salt: str | None = None
    priority: int = 0
    cache_hint: str | None = None


@dataclass(slots=True)
class Job:
    """A parsed inference request ready to run: what it hands the engine, how its choices are
    built from the finished outputs, and how its choices stream (`chunks(run, head,
    include_usage)`: the SSE events of the choices, before the usage and `[DONE]`)."""

    kind: Kind
    inputs: RunInputs
    choices: Callable[[dict[int, RequestOutput]], list]
    chunks: Callable[[RequestRun, Head, bool], AsyncIterator[bytes]]

    def head(self, run: RequestRun, model: str, tier: str) -> Head:
        return head(self.kind, run.id, run.t0, model, tier)

    def body(self, run: RequestRun, model: str, tier: str) -> dict:
        """The JSON answer of a finished run (its usage set by `finish`)."""
        return answer(self.kind, self.head(run, model, tier), self.choices(run.finals), run.usage)


def chunk_usage(run: RequestRun, include_usage: bool) -> dict:
    """A chunk's usage: none; null (`include_usage`: the usage comes in a chunk of its own
    at the end); or, with vLLM's `continuous_usage_stats`, the usage so far."""
    if not include_usage:
        return {}
    return {"usage": run.usage_dict() if run.continuous_usage else None}


# (settings, the tokenizer pool, the parsed request, its model) -> its job
JobMaker = Callable[[Settings, TokenizePool, Any, ModelEntry], Awaitable[Job]]
