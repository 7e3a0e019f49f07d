"""Lockgate's inference engine: paged KV cache, continuous batching, chunked prefill.

The public face, and all a server imports (tests/gateway/test_imports.py holds the gateway
to it): the engine (`AsyncEngine`, a `ModelView` of one of its models, `LLM` for offline
batches) behind the `EngineClient` / `EngineAdmin` protocols and their `RequestStream`;
requests (`SamplingParams`, `StructuredOutputsParams`, `LoRARequest`), outputs, stats and
errors; the grammar compiler structured outputs share (`grammar_compiler`); the model
directory's own `ModelConfig` and `Tokenizer`; and the model tools the command line runs
(`write_demo_model`, `write_demo_adapter`, `quantize_model`). Everything else in
`engine.*` is the engine's inside.
"""

if not __name__.startswith("lockgate."):
    # The repository's top-level folders are importable only as parts of the lockgate namespace,
    # so that no module is loaded twice under two names.
    raise ImportError(f"{__name__!r} is part of Lockgate: import it as 'lockgate.{__name__}'")

from lockgate.engine.async_engine import AsyncEngine
from lockgate.engine.client import EngineAdmin, EngineClient, Prompt, RequestStream, ServedEngine
from lockgate.engine.config import EngineConfig, ModelConfig
from lockgate.engine.demo_model import write_demo_model
from lockgate.engine.errors import (
    AdapterInUse,
    EngineDead,
    EngineError,
    EngineOverloaded,
    GrammarError,
    InvalidRequest,
    LoRAError,
    PromptTooLong,
    UnknownModel,
)
from lockgate.engine.grammar import CompiledGrammar, GrammarCompiler, grammar_compiler
from lockgate.engine.llm import LLM
from lockgate.engine.lora import Adapter, LoRARequest
from lockgate.engine.lora_demo import parse_targets, write_demo_adapter
from lockgate.engine.model_view import ModelView
from lockgate.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lockgate.engine.pool import Pool, PoolConfig, PoolEngine
from lockgate.engine.quant.quantize import QuantizeSpec, default_group_size, quantize_model
from lockgate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from lockgate.engine.stats import (
    CostModelStats,
    EngineStats,
    KVStats,
    LoRAStats,
    OverloadStats,
    PooledModelStats,
    PoolStats,
    QueueBounds,
    QueueStats,
    TenantClassStats,
)
from lockgate.engine.tokenizer import Tokenizer

__all__ = [
    "LLM", "Adapter", "AdapterInUse", "AsyncEngine", "CompiledGrammar", "CompletionOutput", "CostModelStats",
    "EngineAdmin", "EngineClient", "EngineConfig", "EngineDead", "EngineError", "EngineOverloaded", "EngineStats",
    "GrammarCompiler", "GrammarError", "InvalidRequest",
    "KVStats", "LoRAError", "LoRARequest", "LoRAStats", "Logprob", "ModelConfig", "ModelView", "OverloadStats",
    "Pool", "PoolConfig", "PoolEngine",
    "PoolStats", "PooledModelStats", "Prompt", "PromptTooLong", "QuantizeSpec", "QueueBounds", "QueueStats",
    "RequestMetrics", "RequestOutput", "RequestStream", "SamplingParams", "ServedEngine", "StructuredOutputsParams",
    "TenantClassStats", "Tokenizer", "UnknownModel", "default_group_size", "grammar_compiler", "parse_targets",
    "quantize_model", "write_demo_adapter", "write_demo_model",
]
