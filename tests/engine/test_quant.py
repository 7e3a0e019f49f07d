"""Quantized checkpoints (AWQ GEMM, GPTQ v1) in the engine: `lockgate quantize` writes them,
the engine serves them, and greedy output equals HF transformers run on the same weights
dequantized to float (the oracle sees exactly the weights the packed tensors represent).

The format itself (bit order, zero offset, g_idx) is checked against the real packers in
test_quant_fixtures.py; here a checkpoint's float twin is made with kernels/quant's reference
(tests/support/quant.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from lockgate.engine import LLM
from lockgate.engine.quant import AWQConfig, AWQLinear, GPTQLinear, linear_factory
from lockgate.engine.quant.quantize import QuantizeSpec, quantize_weight
from lockgate.gateway.cli import app
from tests.support.helpers import demo_model
from tests.support.quant import assert_greedy_matches_hf, dequantize_checkpoint, run_quantize, write_hf_twin

QUANTIZE_CASES = {
    "awq-g32-llama": ("llama", ["--method", "awq", "--group-size", "32"]),
    "gptq-4bit-sym-g32-llama": ("llama", ["--method", "gptq", "--group-size", "32", "--sym"]),
    "gptq-4bit-asym-descact-g32-qwen2": ("qwen2", ["--method", "gptq", "--group-size", "32", "--asym", "--desc-act"]),
    "gptq-8bit-g64-mistral": ("mistral", ["--method", "gptq", "--bits", "8", "--group-size", "64"]),
}


@pytest.mark.parametrize("case", QUANTIZE_CASES)
def test_quantized_checkpoint_greedy_matches_hf(case, tmp_path):
    family, args = QUANTIZE_CASES[case]
    quant_dir = tmp_path / "quant"
    run_quantize(demo_model(family), str(quant_dir), *args)
    config = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == args[1]
    assert (quant_dir / "tokenizer.json").read_bytes() == (Path(demo_model(family)) / "tokenizer.json").read_bytes()
    hf_dir = write_hf_twin(quant_dir, tmp_path / "hf", dequantize_checkpoint(quant_dir))
    llm = assert_greedy_matches_hf(quant_dir, hf_dir)
    # the packed model is smaller than the dense one, and keeps no dequantized weight
    dense = LLM(model=demo_model(family), dtype="float32").engine.runner.weight_bytes
    assert llm.engine.runner.weight_bytes < dense
    model = llm.engine.runner.model
    assert not any(p.dim() == 2 for name, p in model.named_parameters() if "_proj" in name)


def test_quantize_round_to_nearest_error_is_within_half_a_step():
    """|w - dequant(q)| <= s / 2 wherever no code was clamped (GPTQ's symmetric grid [-8s, 7s]
    clamps the largest positive weights); desc_act's g_idx groups by descending column norm."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 128, generator=g) * torch.rand(1, 128, generator=g) + 0.3
    for spec in (QuantizeSpec("awq", 4, 32, sym=False), QuantizeSpec("gptq", 4, 32, sym=True),
                 QuantizeSpec("gptq", 4, 32, desc_act=True, sym=False), QuantizeSpec("gptq", 8, 64)):
        layer = quantize_weight(w, spec)
        s = layer.scales.float()[layer.g_idx.long()].t()
        z = layer.zeros[layer.g_idx.long()].t()
        err = ((layer.codes - z) * s - w).abs()
        inside = (layer.codes > 0) & (layer.codes < 2**spec.bits - 1)
        assert inside.float().mean() > 0.9, spec
        assert (err[inside] <= s[inside] / 2 + 1e-6).all(), spec
        assert (err <= 1.5 * s + 1e-6).all(), spec      # a clamped extreme: at most one step off
        assert layer.codes.min() >= 0 and layer.codes.max() <= 2**spec.bits - 1
        if spec.method == "gptq" and not spec.sym:
            assert layer.zeros.min() >= 1            # v1 cannot store 0
        if spec.desc_act:
            order = torch.argsort(w.norm(dim=0), descending=True, stable=True)
            assert layer.g_idx[order].tolist() == sorted(layer.g_idx.tolist())
            assert layer.g_idx.tolist() != sorted(layer.g_idx.tolist())


def test_quantize_cli_refuses_bad_options(tmp_path):
    runner = CliRunner()
    for args, words in [
        (["--method", "gptq", "--bits", "3"], "bits: 3"),
        (["--method", "awq", "--bits", "8"], "bits: 8"),
        (["--method", "exl2"], "method: 'exl2'"),
        (["--method", "awq", "--group-size", "48"], "group_size: 48 does not divide"),
        (["--method", "awq", "--desc-act"], "desc_act"),
    ]:
        result = runner.invoke(app, ["quantize", demo_model("llama"), str(tmp_path / "x"), *args])
        assert result.exit_code != 0
        assert words in " ".join(result.output.split()), result.output


# -- bad checkpoints ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gptq")
    run_quantize(demo_model("llama"), str(d), "--method", "gptq", "--group-size", "32")
    return d


def edited_copy(src: Path, dst: Path, config_edit=None, tensor_edit=None) -> Path:
    shutil.copytree(src, dst)
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    if tensor_edit:
        tensors = load_file(str(dst / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


QZ = "model.layers.1.mlp.down_proj.qzeros"
QW = "model.layers.0.self_attn.k_proj.qweight"
GI = "model.layers.0.mlp.up_proj.g_idx"


@pytest.mark.parametrize(
    "config_edit, tensor_edit, message",
    [
        (lambda q: q.update(quant_method="bitsandbytes"), None, r"quant_method: 'bitsandbytes' is not supported"),
        (lambda q: q.update(bits=3), None, r"quantization_config.bits: 3 is not supported"),
        (lambda q: q.update(checkpoint_format="gptq_v2"), None, r"checkpoint_format: 'gptq_v2' is not supported"),
        (lambda q: q.update(format="marlin", checkpoint_format=None), None, r"format: 'marlin' is not supported"),
        (lambda q: q.pop("group_size"), None, r"quantization_config.group_size is missing"),
        (lambda q: q.update(lm_head=True), None, r"lm_head"),
        (None, lambda t: t.pop(QZ), r"missing weights: \['layers.1.mlp.down_proj.qzeros'\]"),
        (None, lambda t: t.update({QW: t[QW][:-1].clone()}), r"k_proj.qweight'.*shape \(7, 32\), expected \(8, 32\)"),
        (None, lambda t: t.update({QW: t[QW].float()}), r"qweight must be int32"),
        (None, lambda t: t.update({GI: t[GI] + 1}), r"up_proj.g_idx'.*groups 1..2, expected 0..1"),
        (None, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64)}),
         r"unexpected tensor 'weight' for a gptq projection"),
    ],
    ids=["method", "bits", "v2", "marlin", "no-group-size", "lm-head", "no-qzeros", "qweight-shape",
         "qweight-dtype", "g_idx-range", "dense-weight"],
)
def test_bad_gptq_checkpoint_is_refused_at_load(gptq_dir, tmp_path, config_edit, tensor_edit, message):
    bad = edited_copy(gptq_dir, tmp_path / "bad", config_edit, tensor_edit)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(bad), dtype="float32")


@pytest.mark.parametrize(
    "config, message",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, r"version: 'gemv' is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "marlin"}, r"version: 'marlin'"),
        ({"quant_method": "awq", "w_bit": 8, "q_group_size": 32, "version": "GEMM"},
         r"w_bit: 8 is not supported|bits: 8"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False}, r"zero_point: False"),
        ({"quant_method": "awq", "bits": 4, "group_size": 32, "modules_to_not_convert": ["mlp.down_proj"]},
         r"modules_to_not_convert"),
        ({"quant_method": "gptq", "bits": 2, "group_size": 32}, r"bits: 2 is not supported"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": "yes"}, r"desc_act: 'yes' is not a boolean"),
        ({"quant_method": "fp8"}, r"quant_method: 'fp8'"),
    ],
)
def test_unsupported_quantization_config_names_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        linear_factory(config)(64, [64], False)


def test_awq_config_accepts_autoawq_names():
    """AutoAWQ's own quant_config.json names (w_bit, q_group_size, version "GEMM")."""
    factory = linear_factory({"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "version": "GEMM",
                              "zero_point": True})
    assert isinstance(factory(64, [64, 32, 32], True), AWQLinear)
    with pytest.raises(ValueError, match="group_size: 48 does not divide in_features 64"):
        AWQLinear(64, [64], False, AWQConfig(group_size=48))
    gptq_factory = linear_factory({"quant_method": "gptq", "bits": 8, "group_size": -1})
    assert isinstance(gptq_factory(64, [64], False), GPTQLinear)
