"""`lockgate quantize`: write an AWQ (GEMM) or GPTQ (v1) checkpoint of a full-precision Hugging
Face model, by round-to-nearest per group (no calibration data: the point is the format).

Every q/k/v/o/gate/up/down projection of the decoder layers is quantized; embeddings, norms
and lm_head are copied as they are. Per group of `group_size` input channels and per output
channel, with maxq = 2^bits - 1:

    AWQ (asymmetric):  s = (max - min) / maxq,  z = round(-min / s) in [0, maxq]
    GPTQ asymmetric:   s = (max(w, 0) - min(w, 0)) / maxq,  z = round(-min / s) in [1, maxq]
                       (v1 stores z - 1, so z = 0 cannot be stored: such a group's range is
                       widened to [-s, max] with z = 1)
    GPTQ symmetric:    s = 2 max|w| / maxq,  z = (maxq + 1) / 2
    q = clamp(round(w / s) + z, 0, maxq), with s rounded to fp16 first (checkpoints hold fp16).

GPTQ with desc_act orders each layer's input channels by descending weight-column norm (the
stand-in for GPTQ's Hessian diagonal) and groups them in that order; g_idx records each
channel's group. The config written is the source's plus the `quantization_config` AutoAWQ
or GPTQModel would write; tokenizer and generation files are copied.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lockgate.engine.models.loader import safetensors_files
from lockgate.kernels.quant import awq_pack, pack_int32

PROJECTION = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.(weight|bias)$")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
Method = Literal["awq", "gptq"]
# AWQ's GEMM layout needs every group whole: the group size must divide each projection's
# input size. The default is the first of these that does (AutoAWQ's 128 on real models;
# the demo models' MLP of 704 takes 64), else one group per row (-1).
AWQ_GROUP_SIZES = (128, 64, 32)
GPTQ_GROUP_SIZE = 128      # GPTQ's last group may be short: any size works


@dataclass(frozen=True, slots=True)
class QuantizeSpec:
    method: Method
    bits: int = 4
    group_size: int = 128      # -1: one group per output channel over all inputs
    desc_act: bool = False     # GPTQ only
    sym: bool = True           # GPTQ only; AWQ is always asymmetric

    def __post_init__(self) -> None:
        if self.method not in ("awq", "gptq"):
            raise ValueError(f"method: {self.method!r} is not one of ('awq', 'gptq')")
        if self.bits not in ((4,) if self.method == "awq" else (4, 8)):
            raise ValueError(f"bits: {self.bits} is not supported for {self.method}")
        if self.group_size != -1 and self.group_size <= 0:
            raise ValueError(f"group_size: {self.group_size} must be positive or -1")
        if self.method == "awq" and (self.desc_act or self.sym):
            raise ValueError("awq: desc_act and sym are GPTQ options (AWQ GEMM is asymmetric, in order)")

    def quantization_config(self) -> dict[str, Any]:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm", "modules_to_not_convert": None}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                "desc_act": self.desc_act, "sym": self.sym, "static_groups": False,
                "true_sequential": True, "checkpoint_format": "gptq",
                "meta": {"quantizer": ["lockgate"], "method": "round-to-nearest"}}


@dataclass(frozen=True, slots=True)
class QuantizedLayer:
    codes: torch.Tensor    # int64 [out, in] in [0, maxq]
    scales: torch.Tensor   # fp16 [groups, out]
    zeros: torch.Tensor    # int64 [groups, out]
    g_idx: torch.Tensor    # int32 [in]


def _group_params(w: torch.Tensor, spec: QuantizeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16 values) and zero point per row of one group's columns w [out, g]."""
    maxq = 2**spec.bits - 1
    lo, hi = w.amin(dim=1), w.amax(dim=1)
    if spec.method == "awq":
        scale = ((hi - lo).clamp(min=1e-5) / maxq).half().float()
        return scale, (-torch.round(lo / scale)).clamp(0, maxq)
    lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    if spec.sym:
        amax = torch.maximum(-lo, hi).clamp(min=1e-5)
        return (2 * amax / maxq).half().float(), torch.full_like(amax, (maxq + 1) // 2)
    scale = ((hi - lo).clamp(min=1e-5) / maxq).half().float()
    zero = torch.round(-lo / scale).clamp(max=maxq)
    narrow = zero < 1    # v1 cannot store a zero point of 0: use [-s, max] with z = 1
    if narrow.any():
        scale = torch.where(narrow, (hi.clamp(min=1e-5) / (maxq - 1)).half().float(), scale)
        zero = torch.where(narrow, torch.ones_like(zero), zero)
    return scale, zero


def quantize_weight(weight: torch.Tensor, spec: QuantizeSpec) -> QuantizedLayer:
    """Round-to-nearest of one HF weight [out, in], grouped along the input."""
    w = weight.float()
    n_out, n_in = w.shape
    gs = n_in if spec.group_size == -1 else spec.group_size
    if spec.method == "awq" and n_in % gs:
        raise ValueError(f"group_size: {gs} does not divide in_features {n_in}")
    order = torch.argsort(w.norm(dim=0), descending=True, stable=True) if spec.desc_act else torch.arange(n_in)
    g_idx = torch.empty(n_in, dtype=torch.int32)
    g_idx[order] = (torch.arange(n_in) // gs).to(torch.int32)
    num_groups = math.ceil(n_in / gs)
    scales, zeros = torch.empty(num_groups, n_out), torch.empty(num_groups, n_out)
    for g in range(num_groups):
        scales[g], zeros[g] = _group_params(w[:, order[g * gs:(g + 1) * gs]], spec)
    s, z = scales[g_idx.long()].t(), zeros[g_idx.long()].t()      # per element [out, in]
    codes = torch.clamp(torch.round(w / s) + z, 0, 2**spec.bits - 1)
    return QuantizedLayer(codes.long(), scales.half(), zeros.long(), g_idx)


def pack_layer(layer: QuantizedLayer, spec: QuantizeSpec) -> dict[str, torch.Tensor]:
    """One layer's checkpoint tensors (without the `<layer>.` prefix)."""
    if spec.method == "awq":
        return {"qweight": awq_pack(layer.codes.t()), "qzeros": awq_pack(layer.zeros), "scales": layer.scales}
    return {
        "qweight": pack_int32(layer.codes.t(), spec.bits, dim=0),
        "qzeros": pack_int32(layer.zeros - 1, spec.bits, dim=1),      # v1: zero - 1
        "scales": layer.scales,
        "g_idx": layer.g_idx,
    }


def projection_in_features(model_dir: str | Path) -> set[int]:
    """The input sizes of the decoder projections `quantize_model` would quantize (from the
    checkpoint's headers; no tensor is read)."""
    sizes: set[int] = set()
    for path in safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if PROJECTION.match(name) and name.endswith(".weight"):
                    sizes.add(f.get_slice(name).get_shape()[1])
    return sizes


def awq_group_sizes(in_features: set[int]) -> list[int]:
    """The `AWQ_GROUP_SIZES` that divide every one of `in_features`, largest first."""
    return [g for g in AWQ_GROUP_SIZES if all(n % g == 0 for n in in_features)]


def default_group_size(model_dir: str | Path, method: str) -> int:
    """The group size `lockgate quantize` uses when none is given: GPTQ's 128; for AWQ the
    largest of `AWQ_GROUP_SIZES` dividing every projection's input size, else -1."""
    if method != "awq":
        return GPTQ_GROUP_SIZE
    fits = awq_group_sizes(projection_in_features(model_dir))
    return fits[0] if fits else -1


def _check_awq_groups(model_dir: Path, spec: QuantizeSpec) -> None:
    """A group size that leaves some AWQ group short: refused up front, naming those that fit."""
    if spec.method != "awq" or spec.group_size == -1:
        return
    sizes = projection_in_features(model_dir)
    bad = sorted(n for n in sizes if n % spec.group_size)
    if bad:
        fits = [str(g) for g in awq_group_sizes(sizes)] + ["-1 (one group per row)"]
        raise ValueError(f"group_size: {spec.group_size} does not divide in_features {bad[0]} "
                         f"(awq needs whole groups); this model takes {' or '.join(fits)}, or "
                         "leave --group-size out to get the largest that fits")


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            # a safetensors handle, not a dict: keys() is its API
            weights.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return weights


def quantize_model(model_dir: str | Path, out_dir: str | Path, spec: QuantizeSpec) -> Path:
    """Write the quantized checkpoint of `model_dir` into `out_dir` and return its path."""
    src, out = Path(model_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ValueError(f"model: {src} is already quantized")
    _check_awq_groups(src, spec)
    tensors: dict[str, torch.Tensor] = {}
    num_layers = 0
    for name, tensor in _read_weights(src).items():
        match = PROJECTION.match(name)
        if match is None:
            tensors[name] = tensor
        elif name.endswith(".bias"):
            tensors[name] = tensor.half()          # as the packers store it
        else:
            layer = name.removesuffix(".weight")
            try:
                packed = pack_layer(quantize_weight(tensor, spec), spec)
            except ValueError as exc:
                raise ValueError(f"{layer}: {exc}") from None
            tensors.update({f"{layer}.{k}": v for k, v in packed.items()})
            num_layers += 1
    if not num_layers:
        raise ValueError(f"model: no decoder projections found in {src}")
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.name != "config.json" and not path.name.endswith(_WEIGHT_FILES):
            shutil.copy2(path, out / path.name)
    config["quantization_config"] = spec.quantization_config()
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
