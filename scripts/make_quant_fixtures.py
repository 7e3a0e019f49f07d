"""Write the golden AWQ / GPTQ fixtures in tests/fixtures/quant/ with the *real* packers,
so Lockgate's unpacking is checked against an independent implementation of each format.

Packers (not project dependencies; run this once, in a throwaway venv):

    python3 -m venv /tmp/qref
    /tmp/qref/bin/pip install torch==2.13.0 numpy safetensors "transformers==4.51.3" accelerate \
        "huggingface-hub<1.0" "datasets==3.6.0" zstandard "peft==0.15.2" gekko rouge sentencepiece
    /tmp/qref/bin/pip install --no-deps autoawq==0.2.9 auto-gptq==0.7.1
    /tmp/qref/bin/python scripts/make_quant_fixtures.py

    AutoAWQ 0.2.9:  awq.quantize.quantizer.AwqQuantizer.pseudo_quantize_tensor (its RTN scales
                    and zeros), awq.modules.linear.gemm.WQLinear_GEMM.from_linear (packing),
                    awq.utils.packing_utils.dequantize_gemm (its dequantization: the golden W),
                    awq.models._config.AwqConfig (the quantization_config).
    AutoGPTQ 0.7.1: auto_gptq.quantization.quantizer.Quantizer.find_params (per-group scales and
                    zeros), auto_gptq.nn_modules.qlinear.qlinear_cuda.QuantLinear.pack (with g_idx;
                    pure torch + numpy) and its CPU forward on an identity input (the golden W),
                    auto_gptq.modeling._base.BaseQuantizeConfig (the quantization_config).

Nothing of Lockgate's quantization code is used here: the golden weights are the packers' own
dequantization of the tensors they packed. Demo models come from `lockgate demo-model`
(the project's venv), read back with safetensors.

Written (every float "weight" is [out, in] fp32, nn.Linear's layout):
    layer_<case>.safetensors   qweight, qzeros, scales (fp16), g_idx (GPTQ), bias (some), weight
    model_<case>/config.json   the demo config + quantization_config as the packer's config writes it
    model_<case>/model.safetensors        the packed checkpoint (other tensors in fp16)
    model_<case>/dequantized.safetensors  the packer's dequantized projection weights (+ biases)
    MANIFEST.json              packages and versions, each case's parameters, SHA-256 of every file
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

warnings.filterwarnings("ignore")

ROOT = Path(__file__).resolve().parents[1]
PROJ = re.compile(r"^model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)\.weight$")

# (name, method, bits, group_size, desc_act, sym, bias)
LAYER_CASES = [
    ("awq_g32", "awq", 4, 32, False, False, False),
    ("awq_g64", "awq", 4, 64, False, False, False),
    ("awq_g128", "awq", 4, 128, False, False, True),
    ("gptq_4bit_sym_g32", "gptq", 4, 32, False, True, True),
    ("gptq_4bit_asym_g64", "gptq", 4, 64, False, False, False),
    ("gptq_4bit_asym_descact_g32", "gptq", 4, 32, True, False, False),
    ("gptq_8bit_sym_g32", "gptq", 8, 32, False, True, False),
    ("gptq_8bit_asym_descact_g64", "gptq", 8, 64, True, False, True),
]
LAYER_IN, LAYER_OUT = 256, 32   # AutoAWQ and AutoGPTQ size qzeros as out // 32 * bits
# (name, family, method, bits, group_size, desc_act, sym)
MODEL_CASES = [
    ("awq_g32_llama", "llama", "awq", 4, 32, False, False),
    ("gptq_4bit_asym_descact_g32_qwen2", "qwen2", "gptq", 4, 32, True, False),
]


# -- AutoAWQ ------------------------------------------------------------------------------------
def awq_pack(weight: torch.Tensor, bias: torch.Tensor | None, group_size: int) -> tuple[dict, torch.Tensor]:
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm

    quantizer = AwqQuantizer.__new__(AwqQuantizer)   # only the RTN helper, no model or data
    quantizer.w_bit, quantizer.group_size, quantizer.zero_point = 4, group_size, True
    _, scales, zeros = quantizer.pseudo_quantize_tensor(weight.clone())
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight.data.copy_(weight)
    if bias is not None:
        linear.bias.data.copy_(bias)
    # as AwqQuantizer._apply_quant hands them over: [groups, out]
    q = WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
    tensors = {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}
    if bias is not None:
        tensors["bias"] = q.bias
    golden = dequantize_gemm(q.qweight, q.qzeros, q.scales.float(), 4, group_size)   # [in, out]
    return tensors, golden.t().contiguous()


def awq_config(group_size: int) -> dict:
    from awq.models._config import AwqConfig

    cfg = AwqConfig.from_dict({"w_bit": 4, "q_group_size": group_size, "zero_point": True, "version": "GEMM"})
    return cfg.to_transformers_dict()


# -- AutoGPTQ -----------------------------------------------------------------------------------
def gptq_pack(
    weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int, desc_act: bool,
    sym: bool, gen: torch.Generator,
) -> tuple[dict, torch.Tensor]:
    from auto_gptq.nn_modules.qlinear.qlinear_cuda import QuantLinear
    from auto_gptq.quantization.quantizer import Quantizer

    out_f, in_f = weight.shape
    perm = torch.randperm(in_f, generator=gen) if desc_act else torch.arange(in_f)
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[perm] = torch.arange(in_f, dtype=torch.int32) // group_size   # as GPTQ's act-order does
    quantizer = Quantizer()
    quantizer.configure(bits, perchannel=True, sym=sym, mse=False)
    scales, zeros = [], []
    for g in range(in_f // group_size):
        quantizer.find_params(weight[:, perm[g * group_size:(g + 1) * group_size]], weight=True)
        scales.append(quantizer.scale.reshape(-1, 1))
        zeros.append(quantizer.zero.reshape(-1, 1))
    scale = torch.cat(scales, 1).half().float()    # checkpoints hold fp16 scales: round first
    zero = torch.cat(zeros, 1)
    if not (zero >= 1).all():
        raise ValueError("a zero point of 0 cannot be stored in GPTQ v1")
    linear = torch.nn.Linear(in_f, out_f, bias=bias is not None)
    linear.weight.data.copy_(weight)
    if bias is not None:
        linear.bias.data.copy_(bias)
    q = QuantLinear(bits, group_size, in_f, out_f, bias is not None, weight_dtype=torch.float32)
    q.pack(linear, scale, zero, g_idx)
    tensors = {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales.half(), "g_idx": q.g_idx.to(torch.int32)}
    if bias is not None:
        tensors["bias"] = q.bias.clone()
    q.bias = None
    with torch.no_grad():
        golden = q(torch.eye(in_f))                                          # [in, out]
    return tensors, golden.t().contiguous()


def gptq_config(bits: int, group_size: int, desc_act: bool, sym: bool) -> dict:
    from auto_gptq.modeling._base import BaseQuantizeConfig

    cfg = BaseQuantizeConfig(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym).to_dict()
    cfg["checkpoint_format"] = "gptq"   # as transformers / GPTQModel write a v1 checkpoint
    return cfg


# -- writing ------------------------------------------------------------------------------------
def pack(method: str, weight, bias, bits, group_size, desc_act, sym, gen) -> tuple[dict, torch.Tensor]:
    if method == "awq":
        return awq_pack(weight, bias, group_size)
    return gptq_pack(weight, bias, bits, group_size, desc_act, sym, gen)


def layer_weight(gen: torch.Generator, sym: bool) -> torch.Tensor:
    w = torch.randn(LAYER_OUT, LAYER_IN, generator=gen) * (0.5 + torch.rand(LAYER_OUT, 1, generator=gen))
    if not sym:   # rows shifted off zero: asymmetric zero points then differ from the middle
        w += torch.randn(LAYER_OUT, 1, generator=gen) * 0.5
    return w


def write_layers(out: Path, cases: dict) -> None:
    for i, (name, method, bits, gs, desc_act, sym, has_bias) in enumerate(LAYER_CASES):
        gen = torch.Generator().manual_seed(1000 + i)
        weight = layer_weight(gen, sym)
        bias = torch.randn(LAYER_OUT, generator=gen) if has_bias else None
        tensors, golden = pack(method, weight, bias, bits, gs, desc_act, sym, gen)
        tensors["weight"] = golden
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"layer_{name}.safetensors"))
        cases[name] = dict(kind="layer", file=f"layer_{name}.safetensors", method=method, bits=bits,
                           group_size=gs, desc_act=desc_act, sym=sym, bias=has_bias,
                           in_features=LAYER_IN, out_features=LAYER_OUT)


def write_models(out: Path, cases: dict, lockgate: str) -> None:
    for i, (name, family, method, bits, gs, desc_act, sym) in enumerate(MODEL_CASES):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([lockgate, "demo-model", tmp, "--family", family, "--size", "tiny"],
                           check=True)
            config = json.loads((Path(tmp) / "config.json").read_text())
            state = load_file(str(Path(tmp) / "model.safetensors"))
        gen = torch.Generator().manual_seed(2000 + i)
        packed, dequantized = {}, {}
        for key, tensor in state.items():
            if not PROJ.match(key):
                if not (key.endswith("_proj.bias") and PROJ.match(key[: -len("bias")] + "weight")):
                    packed[key] = tensor.half()
                continue
            layer = key[: -len(".weight")]
            bias = state.get(layer + ".bias")
            tensors, golden = pack(method, tensor, bias, bits, gs, desc_act, sym, gen)
            packed.update({f"{layer}.{k}": v for k, v in tensors.items()})
            dequantized[key] = golden
            if bias is not None:
                dequantized[layer + ".bias"] = tensors["bias"].float()
        config["quantization_config"] = awq_config(gs) if method == "awq" else gptq_config(bits, gs, desc_act, sym)
        d = out / f"model_{name}"
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in packed.items()}, str(d / "model.safetensors"))
        save_file({k: v.contiguous() for k, v in dequantized.items()}, str(d / "dequantized.safetensors"))
        cases[name] = dict(kind="model", dir=f"model_{name}", family=family, method=method, bits=bits,
                           group_size=gs, desc_act=desc_act, sym=sym)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "quant")
    parser.add_argument("--lockgate", default=str(ROOT / ".venv" / "bin" / "lockgate"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cases: dict = {}
    write_layers(args.out, cases)
    write_models(args.out, cases, args.lockgate)
    files = sorted(p for p in args.out.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    manifest = {
        "generator": "scripts/make_quant_fixtures.py",
        "packages": {p: version(p) for p in ("autoawq", "auto-gptq", "torch", "transformers")},
        "python": sys.version.split()[0],
        "layout": "weight tensors are the packer's dequantization, [out, in] fp32",
        "cases": cases,
        "sha256": {str(p.relative_to(args.out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
    }
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    total = sum(p.stat().st_size for p in files)
    print(f"wrote {len(files)} files, {total / 1024:.0f} KiB, to {args.out}")


if __name__ == "__main__":
    main()
