"""`LLM`: offline batches, as vLLM's. Every prompt is queued at once and the engine steps
until all are done; outputs come back in input order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from lockgate.engine.config import EngineConfig
from lockgate.engine.errors import InvalidRequest
from lockgate.engine.lora import LoRARequest
from lockgate.engine.model_pool import make_core
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.request import EngineRequest
from lockgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lockgate.engine.tokenizer import Tokenizer

PromptType = str | dict[str, Any]


def to_token_ids(tokenizer: Tokenizer, prompt: PromptType | list[int]) -> tuple[str | None, list[int]]:
    """A prompt (text, token ids, or a dict of either) as (text or None, token ids)."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise InvalidRequest("prompt: a dict prompt needs 'prompt_token_ids' or 'prompt'", field="prompt")
    if isinstance(prompt, list):
        return None, list(prompt)
    raise InvalidRequest(f"prompt: expected a string or a dict, got {type(prompt).__name__}",
                         field="prompt")


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.config = EngineConfig(model=str(model), **kwargs)
        self.engine = make_core(self.config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter now (it is read on first use otherwise), as vLLM's."""
        self.engine.add_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        if self.engine.lora is None:
            return False
        return self.engine.lora.remove(lora_int_id)

    def list_loras(self) -> list[str]:
        return [] if self.engine.lora is None else self.engine.lora.stats().in_cpu

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_progress_bar: bool = True,
        use_tqdm: bool | None = None,
        service_class: str = "online",
        priority: int = 0,
        tenant: str = "default",
        cache_salt: str | None = None,
        share_group: str | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | tuple[LoRARequest | None, ...] | None = None,
        model: str | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order. `use_tqdm` is vLLM's
        name for `use_progress_bar`. `tenant`, `cache_salt` and `share_group` scope the
        prefix cache (and the tenant is the fairness key). `lora_request`: one adapter for
        every prompt, or a list with one (or None, the base model) per prompt. `model`: which
        model, in an engine of several (`models=`); None: the first."""
        if use_tqdm is not None:
            use_progress_bar = use_tqdm
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(prompts):
            raise InvalidRequest(
                f"sampling_params: {len(params)} given for {len(prompts)} prompts; pass one or one each",
                field="sampling_params",
            )
        loras = (
            list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        )
        if len(loras) != len(prompts):
            raise InvalidRequest(f"lora_request: {len(loras)} given for {len(prompts)} prompts; "
                                 "pass one or one each", field="lora_request")
        requests = []
        for prompt, sp, lora in zip(prompts, params, loras, strict=True):   # validate all before queueing any
            text, ids = to_token_ids(self.engine.core_for(model).tokenizer, prompt)
            req = EngineRequest(str(next(self._ids)), ids, sp, prompt=text, model=model,
                                service_class=service_class, priority=priority, tenant=tenant,
                                cache_salt=cache_salt, share_group=share_group, lora_request=lora)
            self.engine.validate(req)
            requests.append(req)
        for lora in dict.fromkeys(r.lora_request for r in requests if r.lora_request is not None):
            self.engine.add_lora(lora)   # read from disk now (in prompt order), not inside the step loop
        for req in requests:
            self.engine.add_request(req)
        return self._run(requests, use_progress_bar and len(requests) > 1)

    def _run(self, requests: list[EngineRequest], progress: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = _Progress(len(requests)) if progress else None
        try:
            while self.engine.has_unfinished:
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar:
                            bar.advance()
                if self.engine.failed:   # an adapter that could not be read again
                    _rid, exc = self.engine.failed.pop()
                    for r in requests:
                        self.engine.abort_request(r.request_id)
                    self.engine.failed.clear()
                    raise exc
        finally:
            if bar:
                bar.close()
        return [done[r.request_id] for r in requests]


class _Progress:
    """A transient bar on stderr (as vLLM's), drawn only on a terminal: piped or redirected,
    it writes nothing at all (rich would otherwise end a non-terminal run with a newline)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console
        from rich.progress import Progress

        console = Console(stderr=True)
        self._p = Progress(transient=True, console=console, disable=not console.is_terminal)
        self._p.start()
        self._task = self._p.add_task("generating", total=total)

    def advance(self) -> None:
        self._p.advance(self._task)

    def close(self) -> None:
        self._p.stop()
