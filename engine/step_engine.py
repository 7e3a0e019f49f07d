"""`StepEngine`: what `LLM` and `AsyncEngine` drive, one `step()` at a time. An `EngineCore`
(one model) and a `ModelPool` (several on one memory budget) both are one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lockgate.engine.config import EngineConfig, ModelConfig
    from lockgate.engine.engine_core import EngineCore
    from lockgate.engine.lora import Adapter, LoRAManager, LoRARequest
    from lockgate.engine.outputs import RequestOutput
    from lockgate.engine.request import EngineRequest, RequestState
    from lockgate.engine.stats import EngineStats
    from lockgate.engine.tokenizer import Tokenizer


class StepEngine(Protocol):
    config: EngineConfig
    # (request id, error) of requests that failed after they were queued (an adapter that
    # could not be read again): the driver hands each to its caller
    failed: list[tuple[str, Exception]]

    @property
    def tokenizer(self) -> Tokenizer: ...          # the default model's

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def lora(self) -> LoRAManager | None: ...

    @property
    def served_model_names(self) -> set[str]: ...

    @property
    def requests(self) -> dict[str, RequestState]: ...

    @property
    def has_unfinished(self) -> bool: ...

    def core_for(self, model: str | None) -> EngineCore:
        """The core serving `model` (None: the default); UnknownModel if none does."""
        ...

    def validate(self, req: EngineRequest) -> None:
        """Raise InvalidRequest (naming the field) for anything that could never run."""
        ...

    def add_request(self, req: EngineRequest) -> RequestState: ...

    def abort_request(self, request_id: str) -> RequestOutput | None: ...

    def add_lora(self, lora_request: LoRARequest) -> Adapter: ...

    def set_tenant_weight(self, tenant: str, weight: float) -> None: ...

    def purge_tenant(self, tenant: str) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> EngineStats: ...

    def verify(self, sched: object = None) -> None: ...

    def shutdown(self) -> None: ...
