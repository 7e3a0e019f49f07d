"""`ModelView`: one model of an `AsyncEngine` that serves several (`models=`), as an
`EngineClient` and `EngineAdmin` of its own (engine/client.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from lockgate.engine.client import EngineAdmin, EngineClient, Prompt, RequestStream
from lockgate.engine.config import ModelConfig
from lockgate.engine.lora import Adapter, LoRARequest
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.stats import EngineStats
from lockgate.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from lockgate.engine.async_engine import AsyncEngine


class ModelView(EngineClient, EngineAdmin):
    """Requests submitted through it run on its model (or on one of its adapters,
    `model=<adapter>`), adapters added through it belong to it, and its stats, tokenizer
    and context are that model's. The queue, the step loop, the adapters' names and the
    tenant weights are the whole engine's: starting or shutting down a view starts or shuts
    down its engine."""

    def __init__(self, engine: AsyncEngine, name: str) -> None:
        self.engine = engine
        self.name = name

    # -- EngineClient -------------------------------------------------------------------------
    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str, *,
               model: str | None = None, **kwargs: Any) -> RequestStream:
        return self.engine.submit(prompt, sampling_params, request_id, model=model or self.name,
                                  **kwargs)

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str, *,
                       model: str | None = None, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        async for out in self.engine.generate(prompt, sampling_params, request_id,
                                              model=model or self.name, **kwargs):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        """This model's stats, with the engine's queue (`overload`: one for every model),
        the pool and this model's residency in it."""
        s = self.engine.stats()
        if s.pool is None:
            return s
        own = s.by_model.get(self.name, EngineStats())
        return dataclasses.replace(own, overload=s.overload, pool=s.pool,
                                   residency=s.pool.models.get(self.name))

    @property
    def is_ready(self) -> bool:
        return self.engine.is_ready

    # -- EngineAdmin --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        return await self.engine.add_lora(dataclasses.replace(lora_request, base_model_name=self.name))

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def unload_lora(self, name: str) -> bool:
        return self.engine.unload_lora(name)

    @property
    def loras(self) -> dict[str, LoRARequest]:
        """Every adapter the engine serves, whichever model it belongs to."""
        return self.engine.loras

    @property
    def tenant_weights(self) -> dict[str, float]:
        return self.engine.tenant_weights

    def set_tenant_weight(self, tenant: str, weight: float) -> None:
        self.engine.set_tenant_weight(tenant, weight)

    # -- the model, for callers in this process -----------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.core_for_model(self.name).tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.core_for_model(self.name).model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.core_for_model(self.name).max_model_len
