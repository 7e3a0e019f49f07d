"""Lockgate's inference engine: paged KV cache, continuous batching, chunked prefill.

The public face, and all a server imports (tests/gateway/test_imports.py holds the gateway
to it): the engines (`AsyncEngine` in this process, `ProcessEngine` in a process of its own,
a Ray `Pool` of workers, `LLM` for offline batches), each model of one bound as a `ServedEngine`
by a `ModelBinding`, behind the `EngineClient` / `EngineAdmin` protocols and their `RequestStream`;
requests (`SamplingParams`, `StructuredOutputsParams`, `LoRARequest`), outputs, stats and
errors; the grammar compiler structured outputs share (`grammar_compiler`); the model
directory's own `ModelConfig` and `Tokenizer`; and the model tools the command line runs
(`write_demo_model`, `write_copy_model`, `write_demo_adapter`, `quantize_model`). Everything else in
`lockgate.engine.*` is the engine's inside.
"""

if not __name__.startswith("lockgate."):
    # The repository's top-level folders are importable only as parts of the lockgate namespace,
    # so that no module is loaded twice under two names.
    raise ImportError(f"{__name__!r} is part of Lockgate: import it as 'lockgate.{__name__}'")

from lockgate.engine.async_engine import AsyncEngine
from lockgate.engine.binding import ModelBinding
from lockgate.engine.client import (
    EngineAdmin,
    EngineClient,
    ModelEngine,
    Prompt,
    RequestStream,
    ServedEngine,
    SubmitOptions,
)
from lockgate.engine.config import EngineConfig, ModelConfig, server_engine_defaults
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
    RankFailure,
    RankStartupError,
    UnknownModel,
)
from lockgate.engine.grammar import CompiledGrammar, GrammarCompiler, grammar_compiler
from lockgate.engine.grammar_limits import GrammarTooComplex
from lockgate.engine.llm import LLM
from lockgate.engine.lora import Adapter, LoRARequest
from lockgate.engine.lora_demo import parse_targets, write_demo_adapter
from lockgate.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from lockgate.engine.pool import Pool, PoolConfig
from lockgate.engine.process import ProcessEngine
from lockgate.engine.quant.quantize import QuantizeSpec, default_group_size, quantize_model
from lockgate.engine.sampling_params import SamplingParams, StructuredOutputsParams
from lockgate.engine.spec.config import SpeculativeConfig
from lockgate.engine.spec.copy_model import write_copy_model
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
    SpecClassStats,
    SpecStats,
    TenantClassStats,
    WorkerPoolStats,
)
from lockgate.engine.tokenizer import Tokenizer

__all__ = [
    "LLM", "Adapter", "AdapterInUse", "AsyncEngine", "CompiledGrammar", "CompletionOutput", "CostModelStats",
    "EngineAdmin", "EngineClient", "EngineConfig", "EngineDead", "EngineError", "EngineOverloaded", "EngineStats",
    "GrammarCompiler", "GrammarError", "GrammarTooComplex", "InvalidRequest", "KVStats", "LoRAError", "LoRARequest",
    "LoRAStats",
    "Logprob", "ModelBinding", "ModelConfig", "ModelEngine", "OverloadStats", "Pool", "PoolConfig", "PoolStats",
    "PooledModelStats", "ProcessEngine", "Prompt", "PromptTooLong", "QuantizeSpec", "QueueBounds", "QueueStats",
    "RankFailure",
    "RankStartupError", "RequestMetrics",
    "RequestOutput", "RequestStream", "SamplingParams", "ServedEngine", "SpecClassStats", "SpecStats",
    "SpeculativeConfig", "StructuredOutputsParams", "SubmitOptions",
    "TenantClassStats", "Tokenizer", "UnknownModel", "WorkerPoolStats", "default_group_size", "grammar_compiler",
    "parse_targets", "quantize_model", "server_engine_defaults", "write_copy_model", "write_demo_adapter",
    "write_demo_model",
]
