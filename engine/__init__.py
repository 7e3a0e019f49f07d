"""Lockgate's inference engine: paged KV cache, continuous batching, chunked prefill."""

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineDead, EngineError, EngineOverloaded, PromptTooLong, UnknownModel
from engine.llm import LLM
from engine.lora import LoRAError, LoRARequest
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "AsyncEngine", "EngineConfig", "ModelConfig", "SamplingParams", "LoRARequest", "LoRAError",
    "RequestOutput", "CompletionOutput", "RequestMetrics", "Logprob",
    "EngineError", "EngineOverloaded", "EngineDead", "PromptTooLong", "UnknownModel",
]
