"""Offline, deterministic demo LoRA adapters (PEFT format) for tests and demos.

``write_demo_adapter(base_dir, out_dir, rank=..., targets=..., seed=...)`` loads the Hugging Face
base model in ``base_dir`` with transformers (local files only), wraps it with peft
(``LoraConfig`` + ``get_peft_model``) and writes ``adapter_config.json`` and
``adapter_model.safetensors``, which ``peft.PeftModel.from_pretrained`` loads back.

peft initialises every lora_B to zero (a fresh adapter is a no-op), so both lora_A and lora_B
are overwritten with seeded random values: A ~ N(0, 1/in) and B scaled so that the effective
delta ``scaling * B @ A`` has an entry std of ``DELTA_RATIO`` (0.5) times the std of the base
weight it adapts. That changes the base model's greedy output on most prompts (see
tests/test_lora_demo.py) while keeping every activation in the base model's own range.

Same (base weights, rank, targets, seed, alpha) -> byte-identical files: the tensors come from a
private torch.Generator (the global RNG is left as it was), safetensors gets fixed metadata
({"format": "pt"}, as peft writes) and the JSON is written with sorted keys and sorted
target_modules (peft keeps them in a set, whose order would follow PYTHONHASHSEED).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import warnings
from collections.abc import Iterable

import torch

__all__ = ["DELTA_RATIO", "SHORT_TARGETS", "TARGET_MODULES", "parse_targets", "write_demo_adapter"]

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHORT_TARGETS = {name.removesuffix("_proj"): name for name in TARGET_MODULES}  # q -> q_proj, ...
DELTA_RATIO = 0.5   # std of scaling * B @ A relative to the std of the base weight


def parse_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    """'q,v' or ('q_proj', 'v') -> ('q_proj', 'v_proj'): short or full names, no duplicates."""
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out: list[str] = []
    for raw in items:
        name = str(raw).strip()
        full = SHORT_TARGETS.get(name, name)
        if full not in TARGET_MODULES:
            raise ValueError(
                f"targets: unknown module {name!r}; use {', '.join(SHORT_TARGETS)} "
                f"or {', '.join(TARGET_MODULES)}")
        if full not in out:
            out.append(full)
    if not out:
        raise ValueError("targets: give at least one module")
    return tuple(out)


def write_demo_adapter(
    base_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    rank: int = 8,
    targets: str | Iterable[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    alpha: float | None = None,
) -> pathlib.Path:
    """Write a PEFT LoRA adapter for the model in base_dir into out_dir; returns out_dir.

    rank: the LoRA rank r (>= 1). targets: module names (q_proj, ... or q, k, v, o, gate, up,
    down). alpha: lora_alpha, default 2 * rank (scaling alpha / r = 2)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    target_modules = parse_targets(targets)
    if alpha is None:
        alpha = 2 * rank
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    base_dir = pathlib.Path(base_dir)
    if not (base_dir / "config.json").is_file():
        raise ValueError(f"base_dir: {str(base_dir)!r} is not a model directory (no config.json)")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft's own init draws from the global RNG; transformers 5 warns about a deprecated
        # gradient-checkpointing query that peft makes
        warnings.simplefilter("ignore", FutureWarning)
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, local_files_only=True)
        config = LoraConfig(
            r=rank,
            lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; it divides a float alpha as is
            target_modules=list(target_modules),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, config)

    _randomize(model, rank, alpha, seed, target_modules, base_dir)
    return _save(model, pathlib.Path(out_dir), base_dir)


def _randomize(model, rank: int, alpha: float, seed: int, target_modules: tuple[str, ...],
               base_dir: pathlib.Path) -> None:
    """Seeded A and B for every LoRA layer, B scaled so each delta is DELTA_RATIO of its base."""
    scaling = alpha / rank
    g = torch.Generator().manual_seed(seed)
    lora_layers = sorted(
        (name, module) for name, module in model.named_modules()
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}))
    if not lora_layers:
        raise ValueError(f"targets: none of {target_modules} is a module of the model in {base_dir}")
    with torch.no_grad():
        for _, module in lora_layers:
            a = module.lora_A["default"].weight      # [r, in]
            b = module.lora_B["default"].weight      # [out, r]
            in_features = a.shape[1]
            base_std = module.get_base_layer().weight.float().std().item()
            # std(scaling * B @ A) = scaling * b_std * sqrt(r / in) = DELTA_RATIO * base_std
            b_std = DELTA_RATIO * base_std / (scaling * math.sqrt(rank / in_features))
            a.copy_(torch.randn(a.shape, generator=g) / math.sqrt(in_features))
            b.copy_(torch.randn(b.shape, generator=g) * b_std)


def _save(model, out: pathlib.Path, base_dir: pathlib.Path) -> pathlib.Path:
    """The adapter as peft's save_pretrained writes it: weights and config."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = get_peft_model_state_dict(model)
    tensors = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sorted(state.items())}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})

    cfg = model.peft_config["default"].to_dict()
    for key, value in list(cfg.items()):
        if isinstance(value, (set, frozenset)):
            cfg[key] = sorted(value)
    cfg["base_model_name_or_path"] = str(base_dir)
    cfg["inference_mode"] = True   # as peft's save_pretrained writes it
    (out / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    return out
