"""`ModelBinding`: one model of a `ModelEngine` (an `AsyncEngine`, a Ray `Pool`), or one
adapter on it, as a `ServedEngine` of its own. Requests submitted through it run on its model
or adapter unless they name another (`model=`); adapters added through it belong to its
model; its stats are its model's. The queue, the step loop, the adapters' names and the
tenant weights are the whole engine's: starting or shutting down a binding starts or shuts
down its engine."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Unpack

from lockgate.engine.client import ModelEngine, Prompt, RequestStream, ServedEngine, SubmitOptions
from lockgate.engine.errors import UnknownModel
from lockgate.engine.lora import Adapter, LoRARequest
from lockgate.engine.outputs import RequestOutput
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.stats import EngineStats


class ModelBinding(ServedEngine):
    def __init__(self, engine: ModelEngine, model: str, adapter: str | None = None) -> None:
        self.engine = engine
        self.model = model
        self.adapter = adapter          # an adapter on `model`: what requests run on

    def with_adapter(self, adapter: str) -> ModelBinding:
        """The same model's adapter `adapter`, bound."""
        return ModelBinding(self.engine, self.model, adapter)

    # -- EngineClient -------------------------------------------------------------------------
    def submit(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
               **options: Unpack[SubmitOptions]) -> RequestStream:
        """UnknownModel (nothing queued) for an adapter removed since it was bound."""
        if self.adapter is not None and self.adapter not in self.engine.loras:
            raise UnknownModel(f"model: adapter {self.adapter!r} is not served", field="model")
        options["model"] = options.get("model") or self.adapter or self.model
        return self.engine.submit(prompt, sampling_params, request_id, **options)

    def generate(self, prompt: Prompt, sampling_params: SamplingParams, request_id: str,
                 **options: Unpack[SubmitOptions]) -> AsyncIterator[RequestOutput]:
        return self.submit(prompt, sampling_params, request_id, **options).outputs()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.model_stats(self.model)

    @property
    def is_ready(self) -> bool:
        return self.engine.is_ready

    # -- EngineAdmin --------------------------------------------------------------------------
    async def start(self) -> None:
        await self.engine.start()

    async def shutdown(self) -> None:
        await self.engine.shutdown()

    async def add_lora(self, lora_request: LoRARequest) -> Adapter:
        return await self.engine.add_lora(dataclasses.replace(lora_request, base_model_name=self.model))

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

    def purge_tenant(self, tenant: str) -> None:
        self.engine.purge_tenant(tenant)
