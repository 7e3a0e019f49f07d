"""Adapters on disk, in PEFT's format: `LoRARequest` (which adapter a request runs with),
`Adapter` (one parsed and checked in host memory) and `read_adapter`, which checks the config
and the tensors against the base model's projections and names the field or file at fault.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from lockgate.engine.errors import LoRAError
from lockgate.engine.models.linear import LinearBase

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# "<layer>.lora_A.weight" as peft saves it ("<layer>.lora_A.default.weight" from older saves)
_LORA_TENSOR = re.compile(r"(?P<layer>.+)\.(?P<kind>lora_A|lora_B)(?:\.default)?\.weight")


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs with, as vLLM's: a name, a positive integer id unique
    per adapter, and the adapter's directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None    # in an engine of several base models: whose adapter

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name: must be a non-empty string, got {self.lora_name!r}", field="lora_name")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}", field="lora_int_id")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise LoRAError(f"lora_path: must be a non-empty string, got {self.lora_path!r}")


@dataclass(slots=True)
class Adapter:
    """A parsed, checked adapter in host memory."""

    request: LoRARequest
    rank: int                     # the largest rank of its layers
    scaling_alpha: float
    use_rslora: bool
    # HF layer path ("layers.0.self_attn.q_proj") -> (A [r, in], B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    targets: tuple[str, ...]      # module names, e.g. ("q_proj", "v_proj")

    def scaling(self, r: int) -> float:
        return self.scaling_alpha / (math.sqrt(r) if self.use_rslora else r)


def read_adapter(
    request: LoRARequest,
    projections: dict[str, tuple[LinearBase, int]],
    max_lora_rank: int,
    dtype: torch.dtype,
) -> Adapter:
    """Parse and check an adapter against the base model's projections. Raises LoRAError
    naming the file or field; nothing is kept when it does."""
    cfg, alpha = _read_config(request)
    pairs = _read_tensors(Path(request.lora_path) / ADAPTER_WEIGHTS)
    weights, max_r = _check_weights(pairs, projections, max_lora_rank, dtype)
    targets = tuple(sorted({layer.rpartition(".")[2] for layer in weights}))
    return Adapter(request, max_r, float(alpha), bool(cfg.get("use_rslora", False)), weights, targets)


def _read_config(request: LoRARequest) -> tuple[dict, float]:
    """The adapter directory's files present and its config supported: (config, lora_alpha)."""
    path = Path(request.lora_path)
    cfg_path, w_path = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not path.is_dir():
        raise LoRAError(f"lora_path: {request.lora_path!r} is not a directory")
    if not cfg_path.is_file():
        raise LoRAError(f"lora_path: {request.lora_path!r} has no {ADAPTER_CONFIG}")
    if not w_path.is_file():
        raise LoRAError(f"lora_path: {request.lora_path!r} has no {ADAPTER_WEIGHTS}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{ADAPTER_CONFIG}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{ADAPTER_CONFIG}: must be a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAError(f"{ADAPTER_CONFIG}: peft_type {peft_type!r} is not supported (only LORA)")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) is bad:
            raise LoRAError(f"{ADAPTER_CONFIG}: {key}={bad} is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAError(f"{ADAPTER_CONFIG}: bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"{ADAPTER_CONFIG}: modules_to_save {cfg['modules_to_save']!r} is not supported")
    if cfg.get("alpha_pattern"):
        raise LoRAError(f"{ADAPTER_CONFIG}: alpha_pattern is not supported")
    r_cfg, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(r_cfg, bool) or not isinstance(r_cfg, int) or r_cfg < 1:
        raise LoRAError(f"{ADAPTER_CONFIG}: r must be an integer >= 1, got {r_cfg!r}")
    alpha = 8 if alpha is None else alpha   # peft's default
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"{ADAPTER_CONFIG}: lora_alpha must be a number, got {alpha!r}")
    return cfg, alpha


def _read_tensors(w_path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Layer -> {"lora_A": A, "lora_B": B}, as the weights file holds them."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(w_path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict: keys() is its API
                m = _LORA_TENSOR.fullmatch(name.removeprefix("base_model.model.").removeprefix("model."))
                if m is None:
                    raise LoRAError(f"{ADAPTER_WEIGHTS}: tensor {name!r} is not a LoRA A/B weight this engine reads")
                pairs.setdefault(m["layer"], {})[m["kind"]] = f.get_tensor(name)
    except LoRAError:
        raise
    except (SafetensorError, OSError) as exc:   # a corrupt file, or one that cannot be opened
        raise LoRAError(f"{ADAPTER_WEIGHTS}: cannot be read ({exc})") from None
    if not pairs:
        raise LoRAError(f"{ADAPTER_WEIGHTS}: holds no LoRA weights")
    return pairs


def _check_weights(
    pairs: dict[str, dict[str, torch.Tensor]],
    projections: dict[str, tuple[LinearBase, int]],
    max_lora_rank: int,
    dtype: torch.dtype,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], int]:
    """Each layer's A and B checked against the base model's projection: (weights in
    `dtype`, the largest rank)."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    max_r = 0
    for layer, ab in sorted(pairs.items()):
        if layer not in projections:
            raise LoRAError(
                f"{ADAPTER_WEIGHTS}: layer {layer!r} is not a projection of the base model "
                "(an adapter of another base model?)", field="base_model_name"
            )
        if set(ab) != {"lora_A", "lora_B"}:
            raise LoRAError(f"{ADAPTER_WEIGHTS}: layer {layer!r} lacks {({'lora_A', 'lora_B'} - set(ab)).pop()}")
        a, b = ab["lora_A"], ab["lora_B"]
        module, part = projections[layer]
        in_f, out_f = module.full_sizes(part)     # the whole model's, split across ranks or not
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f \
                or a.shape[0] != b.shape[1]:
            raise LoRAError(
                f"{ADAPTER_WEIGHTS}: layer {layer!r} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base "
                f"model needs A [r, {in_f}] and B [{out_f}, r] (an adapter of another base model?)",
                field="base_model_name",
            )
        r = a.shape[0]
        if r > max_lora_rank:
            raise LoRAError(f"{ADAPTER_CONFIG}: rank {r} (layer {layer!r}) exceeds max_lora_rank {max_lora_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"{ADAPTER_WEIGHTS}: layer {layer!r} holds non-finite values")
        weights[layer] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        max_r = max(max_r, r)
    return weights, max_r
