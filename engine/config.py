"""Engine and model configuration, checked on construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lockgate.engine.spec.config import SpeculativeConfig, check_draft_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(slots=True)
class EngineConfig:
    """Everything `LLM` and `AsyncEngine` take besides the model directory."""

    model: str
    served_model_name: str | None = None  # the model's name (default: its directory's name)
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    # the host-memory KV tier, GiB (vLLM's name): None: min(the device cache's size, a quarter
    # of the host's available memory, 16 GiB); 0: off (engine/kv_cache/host_tier.py)
    kv_offloading_size: float | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: Literal["priority", "fcfs"] = "priority"
    seed: int = 0
    # most urgent first; the gateway's tiers map onto them: priority, default -> online,
    # flex -> offline (gateway/serving/tiers.py TIERS)
    service_classes: tuple[str, ...] = ("priority", "online", "offline")
    # bounded queues (engine/admission.py): the tokens (prompt + max_tokens) of every waiting
    # request (None: sized from the KV cache and the cost model), and optionally a count of
    # requests of each class (None: no count bound)
    max_waiting_per_class: int | None = None
    max_waiting_tokens: int | None = None
    # step sizing (engine/scheduler.py): while a more urgent class has work in sight (running,
    # waiting, or arrived within `urgent_window_s`), less urgent prefill fills a step only up
    # to that class's step-time target: `slo[class]` ({"ttft_ms": .., "tpot_ms": ..}) when
    # set, else `step_time_multiple` x the predicted time of the step's decodes (and the
    # urgent class's prefill), at least the urgent part plus a chunk (engine/step_sizing.py)
    slo: dict[str, dict[str, float]] = field(default_factory=dict)
    step_time_multiple: float = 1.0
    urgent_window_s: float = 60.0
    # share of the KV blocks that less urgent classes may not take, e.g. {"online": 0.2}
    reserved_kv_fraction: dict[str, float] = field(default_factory=dict)
    # most prefill tokens a class may compute per step, e.g. {"offline": 256}: bounds the
    # step time that background prefill adds (chunked prefill only)
    prefill_token_budget: dict[str, int] = field(default_factory=dict)
    num_threads: int | None = None
    # LoRA (engine/lora.py): adapters per step, the largest rank, adapters kept in host memory
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # more base models on the same device budget (engine/model_pool.py): name -> directory
    models: dict[str, str] = field(default_factory=dict)
    memory_budget: int | None = None      # bytes for all models together (CPU; CUDA: a share of the device)
    switch_overhead: float = 0.1          # a model's turn lasts until its switch-in cost is this share
    min_turn_s: float = 0.5               # shortest turn, whatever switching costs
    max_drain_s: float = 2.0              # after its turn, how long a model may finish what runs
    # tensor parallelism (engine/parallel/): the model split over this many ranks, rank 0 this
    # process, the others spawned ('mp'); 1 spawns nothing and never touches torch.distributed.
    # Every collective and every hand-off to a rank waits at most `distributed_timeout_s`; a
    # rank's start-up (loading its shard) at most `rank_start_timeout_s`
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None    # None: 'mp' where tensor_parallel_size > 1
    distributed_timeout_s: float = 60.0
    rank_start_timeout_s: float = 600.0
    # speculative decoding, vLLM's dict (engine/spec/config.py): {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m}, or a draft
    # model {"model": DIR, "num_speculative_tokens": k} (engine/spec/draft_model.py); None: off.
    # Kept as the checked SpeculativeConfig
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        """Every setting checked (ValueError naming it), in this order."""
        self._check_step_settings()
        self._check_lora_and_models()
        self._check_memory()
        self._check_classes()
        self._check_parallel()
        self.speculative_config = spec = SpeculativeConfig.of(self.speculative_config)
        if not Path(self.model).is_dir():
            raise ValueError(f"model must be a model directory; {self.model!r} is not one")
        check_draft_model(spec, self.model)

    def _check_step_settings(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N]; got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1; got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("max_waiting_per_class", "max_waiting_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None; got {value!r}")
        for name in ("step_time_multiple", "urgent_window_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a number; got {value!r}")
        if self.step_time_multiple < 1.0:
            raise ValueError(f"step_time_multiple must be >= 1; got {self.step_time_multiple!r}")
        if self.urgent_window_s < 0:
            raise ValueError(f"urgent_window_s must be >= 0; got {self.urgent_window_s!r}")

    def _check_lora_and_models(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int) \
                or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}); "
                             f"got {self.max_cpu_loras!r}")
        self.models = {str(k): str(v) for k, v in dict(self.models or {}).items()}
        for name, path in self.models.items():
            if not name:
                raise ValueError("models: a model name must not be empty")
            if not Path(path).is_dir():
                raise ValueError(f"models[{name!r}]: {path!r} is not a model directory")
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool)
                                               or not isinstance(self.memory_budget, int) or self.memory_budget < 1):
            raise ValueError(f"memory_budget must be a positive byte count; got {self.memory_budget!r}")
        if not 0.0 < self.switch_overhead < 1.0:
            raise ValueError(f"switch_overhead must be in (0, 1); got {self.switch_overhead!r}")
        for name in ("min_turn_s", "max_drain_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)!r}")

    def _check_memory(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2; got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1; got {self.num_kv_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be a positive byte count; got {self.kv_cache_memory}")
        if self.kv_offloading_size is not None and not self.kv_offloading_size >= 0:
            raise ValueError(f"kv_offloading_size must be >= 0 (GiB; 0: off); got {self.kv_offloading_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}"
            )
        if self.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError(
                f"scheduling_policy must be 'priority' or 'fcfs'; got {self.scheduling_policy!r}"
            )

    def _check_classes(self) -> None:
        self.service_classes = tuple(self.service_classes)
        if not self.service_classes or len(set(self.service_classes)) != len(self.service_classes):
            raise ValueError("service_classes must be a non-empty list of distinct names")
        self.reserved_kv_fraction = dict(self.reserved_kv_fraction or {})
        for cls, frac in self.reserved_kv_fraction.items():
            if cls not in self.service_classes:
                raise ValueError(f"reserved_kv_fraction: {cls!r} is not one of {list(self.service_classes)}")
            if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac < 1.0:
                raise ValueError(f"reserved_kv_fraction[{cls!r}] must be in [0, 1); got {frac!r}")
        self.prefill_token_budget = dict(self.prefill_token_budget or {})
        for cls, cap in self.prefill_token_budget.items():
            if cls not in self.service_classes:
                raise ValueError(f"prefill_token_budget: {cls!r} is not one of {list(self.service_classes)}")
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(f"prefill_token_budget[{cls!r}] must be an integer >= 1; got {cap!r}")
        self.slo = {str(k): dict(v) for k, v in dict(self.slo or {}).items()}
        for cls, targets in self.slo.items():
            if cls not in self.service_classes:
                raise ValueError(f"slo: {cls!r} is not one of {list(self.service_classes)}")
            for key, value in targets.items():
                if key not in ("ttft_ms", "tpot_ms"):
                    raise ValueError(f"slo[{cls!r}]: unknown target {key!r}; known: ttft_ms, tpot_ms")
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                    raise ValueError(f"slo[{cls!r}][{key!r}] must be a number of milliseconds > 0; got {value!r}")
        if sum(self.reserved_kv_fraction.values()) >= 1.0:
            raise ValueError("reserved_kv_fraction: the shares must add up to less than 1")

    def _check_parallel(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.pipeline_parallel_size > 1:
            raise ValueError(f"pipeline_parallel_size: {self.pipeline_parallel_size} is not supported; "
                             "only 1 (split a model with tensor_parallel_size instead)")
        backend = self.distributed_executor_backend
        if backend not in (None, "mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray'; got {backend!r}")
        for name in ("distributed_timeout_s", "rank_start_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a number of seconds > 0; got {value!r}")
        if self.tensor_parallel_size > 1 and backend is None:
            self.distributed_executor_backend = "mp"

    def step_target_s(self, cls: str) -> float | None:
        """The step-time target `slo` sets for class `cls` (a first token takes about two
        steps: the one in flight and its own), None when it sets none."""
        targets = self.slo.get(cls) or {}
        bounds = [targets["tpot_ms"] / 1000.0] if "tpot_ms" in targets else []
        if "ttft_ms" in targets:
            bounds.append(targets["ttft_ms"] / 2000.0)
        return min(bounds) if bounds else None

    def resolve_device(self) -> torch.device:
        return resolve_device(self.device)


def resolve_device(device: str) -> torch.device:
    """"auto": CUDA where there is one, else the CPU; any other name as torch reads it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# vLLM's OpenAI server on the CPU runs at most 128 sequences a step (its offline LLM class, as
# ours, 256): a decode step's time is every stream's time per token, and on a CPU it grows with
# the batch about as fast as the batch's throughput does (docs/benchmarks.md, bench serve)
SERVER_CPU_MAX_NUM_SEQS = 128


def server_engine_defaults(device: str = "auto") -> dict[str, Any]:
    """What an embedded server's engine takes where its settings say nothing (they win):
    on the CPU, `max_num_seqs` 128."""
    return {"max_num_seqs": SERVER_CPU_MAX_NUM_SEQS} if resolve_device(device).type == "cpu" else {}


@dataclass(slots=True)
class ModelConfig:
    """What the engine needs of a Hugging Face config.json."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    torch_dtype: str
    eos_token_ids: list[int] = field(default_factory=list)
    max_model_len: int = 0
    quantization: dict[str, Any] | None = None   # config.json's quantization_config

    def context_length(self, max_model_len: int | None) -> int:
        """The context a request may use: `max_model_len` when set (never past the model's
        `max_position_embeddings`), else the model's whole; kept in `self.max_model_len`."""
        if max_model_len and max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings {self.max_position_embeddings}"
            )
        self.max_model_len = max_model_len or self.max_position_embeddings
        return self.max_model_len

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"model: {model_dir} has no config.json")
        raw = json.loads(path.read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: architectures {archs} not supported; supported: {SUPPORTED_ARCHITECTURES}"
            )
        heads = raw["num_attention_heads"]
        model_type = raw.get("model_type", "llama")
        rope_scaling = raw.get("rope_scaling") or None
        rope_params = raw.get("rope_parameters") or None  # transformers >= 5 spelling
        rope_theta = raw.get("rope_theta")
        if rope_params:
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        eos = _eos_ids(model_dir, raw)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 has q/k/v biases and no attention_bias key; Llama/Mistral say so explicitly.
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos,
            quantization=raw.get("quantization_config") or None,
        )


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> list[int]:
    gen = model_dir / "generation_config.json"
    value = None
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        value = raw.get("eos_token_id")
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]
