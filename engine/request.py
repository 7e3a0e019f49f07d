"""Requests as the engine sees them, and the sequences (samples) they fan out into."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lockgate.engine.errors import InvalidRequest, PromptTooLong
from lockgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher
    from tokenizers.decoders import DecodeStream

    from lockgate.engine.kv_cache.block_pool import BlockHash
    from lockgate.engine.lora import LoRARequest
    from lockgate.engine.outputs import Logprob


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """One caller's request, validated, as it enters the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prompt: str | None = None
    tenant: str = "default"           # opaque to the engine: the fairness key
    service_class: str = "online"     # one of EngineConfig.service_classes, most urgent first
    priority: int = 0                 # smaller runs sooner, within its tenant and class
    model: str | None = None          # model variant: base, quantized, or base+LoRA
    cache_salt: str | None = None     # mixed into prefix-cache hashes
    share_group: str | None = None    # prefix blocks shared across tenants of this group only
    tenant_weight: float | None = None  # the tenant's fairness weight, if the caller sets it here
    lora_request: LoRARequest | None = None   # the adapter it runs with; None: the base model

    @property
    def lora_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"   # waiting again, to be recomputed
    FINISHED = "finished"


_arrival_counter = itertools.count()


@dataclass(slots=True)
class RequestState:
    """Shared by the n sequences of one request."""

    req: EngineRequest
    class_rank: int
    arrival_time: float = field(default_factory=time.time)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def finished(self) -> bool:
        return all(s.status is SeqStatus.FINISHED for s in self.seqs)


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of a request: its tokens, KV progress and output state."""

    state: RequestState
    index: int                                  # sample index in [0, n)
    token_ids: list[int]
    num_prompt_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # detokenized output
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_text_tokens: int = 0                    # output tokens the text so far accounts for
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    decode_stream: DecodeStream | None = None
    grammar: LLMatcher | None = None            # structured outputs: where its output stands

    @property
    def seq_id(self) -> str:
        rid = self.state.req.request_id
        return rid if len(self.state.seqs) <= 1 else f"{rid}#{self.index}"

    @property
    def params(self) -> SamplingParams:
        return self.state.req.sampling

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        # num_output_tokens > 0 and num_pending_tokens == 1, spelled out: the scheduler asks
        # this of every running sequence several times a step
        n = len(self.token_ids)
        return n > self.num_prompt_tokens and n - self.num_computed_tokens == 1

    @property
    def fcfs_key(self) -> tuple[int, int]:
        return (self.state.arrival_seq, self.index)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )


def check_request(req: EngineRequest, vocab_size: int, max_model_len: int) -> None:
    """The checks of a request that need no engine state beyond the model's vocabulary and
    context: InvalidRequest (PromptTooLong for the context) naming the field."""
    if not isinstance(req.sampling, SamplingParams):
        raise InvalidRequest(f"sampling_params: expected SamplingParams, got {type(req.sampling).__name__}",
                             field="sampling_params")
    req.sampling.__post_init__()   # re-checked: the object may have changed since it was built
    if type(req.priority) is not int:
        raise InvalidRequest(f"priority: must be an integer, got {req.priority!r}", field="priority")
    if req.tenant_weight is not None and (
        isinstance(req.tenant_weight, bool) or not isinstance(req.tenant_weight, (int, float))
        or not 0 < req.tenant_weight < float("inf")
    ):
        raise InvalidRequest(f"tenant_weight: must be a number > 0, got {req.tenant_weight!r}",
                             field="tenant_weight")
    for name in ("tenant", "model", "cache_salt", "share_group"):
        value = getattr(req, name)
        if (value is not None and not isinstance(value, str)) or (name == "tenant" and not value):
            raise InvalidRequest(
                f"{name}: must be a{' non-empty' if name == 'tenant' else ''} string, got {value!r}",
                field=name)
    bad_bias = next((t for t in req.sampling.logit_bias or {} if t >= vocab_size), None)
    if bad_bias is not None:
        raise InvalidRequest(f"logit_bias: token id {bad_bias} is outside the vocabulary [0, {vocab_size})",
                             field="logit_bias")
    ids = req.prompt_token_ids
    if not isinstance(req.request_id, str) or not req.request_id:
        raise InvalidRequest("request_id: must be a non-empty string", field="request_id")
    if not ids:
        raise InvalidRequest("prompt: must not be empty", field="prompt")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab_size})",
                             field="prompt_token_ids")
    if len(ids) >= max_model_len:
        raise PromptTooLong(
            f"prompt: {len(ids)} tokens leave no room for output within max_model_len {max_model_len}"
        )
