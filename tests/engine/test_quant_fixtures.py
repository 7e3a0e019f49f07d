"""Lockgate's AWQ / GPTQ unpacking against the real packers' own output.

tests/fixtures/quant/ was written once by scripts/make_quant_fixtures.py with AutoAWQ 0.2.9
(WQLinear_GEMM.from_linear, dequantize_gemm) and AutoGPTQ 0.7.1 (QuantLinear.pack with g_idx,
its CPU forward); MANIFEST.json names the versions and holds every file's SHA-256. Each
layer case holds the packed tensors and the weight the packer says they represent; each
model case a whole tiny packed checkpoint and the packer's dequantized projections, so HF
transformers on those floats is the oracle for the engine on the packed checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from lockgate.engine.quant import AWQConfig, AWQLinear, GPTQConfig, GPTQLinear
from lockgate.kernels.quant import awq_dequantize, awq_matmul, gptq_dequantize, gptq_matmul, reference
from tests.support.quant import assert_greedy_matches_hf, copy_tokenizer, write_hf_twin

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
LAYERS = {k: v for k, v in MANIFEST["cases"].items() if v["kind"] == "layer"}
MODELS = {k: v for k, v in MANIFEST["cases"].items() if v["kind"] == "model"}


def dequantize(case: dict, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our reading of a case's tensors: W [in, out] in fp32."""
    scales = t["scales"].float()
    if case["method"] == "awq":
        return awq_dequantize(t["qweight"], t["qzeros"], scales, case["group_size"])
    return gptq_dequantize(t["qweight"], t["qzeros"], scales, t["g_idx"], case["bits"])


def test_manifest_hashes_match_the_files():
    assert set(MANIFEST["packages"]) >= {"autoawq", "auto-gptq"}
    on_disk = {str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*") if p.is_file()} - {"MANIFEST.json"}
    assert on_disk == set(MANIFEST["sha256"])
    for name, digest in MANIFEST["sha256"].items():
        assert hashlib.sha256((FIXTURES / name).read_bytes()).hexdigest() == digest, name
    assert sum((FIXTURES / n).stat().st_size for n in on_disk) < 2 * 1024 * 1024


def test_fixtures_cover_the_formats():
    kinds = {(c["method"], c["bits"], c["group_size"], c["desc_act"], c["sym"]) for c in LAYERS.values()}
    assert {("awq", 4, g, False, False) for g in (32, 64, 128)} <= kinds
    assert {k[:2] for k in kinds if k[0] == "gptq"} == {("gptq", 4), ("gptq", 8)}
    assert any(k[3] for k in kinds) and any(k[4] for k in kinds) and any(not k[4] for k in kinds if k[0] == "gptq")
    assert {c["method"] for c in MODELS.values()} == {"awq", "gptq"}


@pytest.mark.parametrize("name", LAYERS)
def test_dequantize_reproduces_the_packers_weight_exactly(name):
    case = LAYERS[name]
    t = load_file(str(FIXTURES / case["file"]))
    want = t["weight"]                                     # [out, in], the packer's dequantization
    assert want.shape == (case["out_features"], case["in_features"])
    assert torch.equal(dequantize(case, t).t(), want)
    if case["desc_act"]:
        assert t["g_idx"].tolist() != sorted(t["g_idx"].tolist()), "desc_act fixture has a shuffled g_idx"


@pytest.mark.parametrize("name", LAYERS)
def test_fp16_dequantize_is_the_weight_rounded_to_fp16(name):
    case = LAYERS[name]
    t = load_file(str(FIXTURES / case["file"]))
    if case["method"] == "awq":
        w = awq_dequantize(t["qweight"], t["qzeros"], t["scales"], case["group_size"])
    else:
        w = gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], case["bits"])
    assert w.dtype == torch.float16
    assert torch.equal(w.t(), t["weight"].half())


@pytest.mark.parametrize("name", LAYERS)
def test_projection_module_matches_linear_on_the_packers_weight(name):
    """AWQLinear / GPTQLinear built as the loader builds them (meta, to_empty, .to(dtype)),
    loaded as two fused parts (the case's tensors twice), against F.linear on the golden W."""
    case = LAYERS[name]
    t = load_file(str(FIXTURES / case["file"]))
    n_in, n_out, bias = case["in_features"], case["out_features"], case["bias"]
    with torch.device("meta"):
        if case["method"] == "awq":
            module = AWQLinear(n_in, [n_out, n_out], bias, AWQConfig(case["group_size"]))
        else:
            config = GPTQConfig(case["bits"], case["group_size"], case["desc_act"], case["sym"])
            module = GPTQLinear(n_in, [n_out, n_out], bias, config)
    module = module.to_empty(device="cpu").to(torch.float32)
    for part in (0, 1):
        for key in module.specs:
            module.load_part(part, key, t[key])
    assert module.qweight.dtype == torch.int32 and module.scales.dtype == torch.float32
    weight = torch.cat([t["weight"], t["weight"]])
    b = torch.cat([t["bias"], t["bias"]]).float() if bias else None
    x = torch.randn(5, n_in, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(module(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(module.dense_weight(), weight)
    # the functional helpers agree
    s = t["scales"].float()
    if case["method"] == "awq":
        y = awq_matmul(x, t["qweight"], t["qzeros"], s, case["group_size"], t.get("bias"))
    else:
        y = gptq_matmul(x, t["qweight"], t["qzeros"], s, t["g_idx"], case["bits"], t.get("bias"))
    torch.testing.assert_close(y, F.linear(x, t["weight"], b[:n_out] if bias else None), rtol=1e-5, atol=1e-5)


def test_a_wrong_layout_breaks_the_golden_check(monkeypatch):
    """The fixtures have teeth: AWQ read in plain order, or GPTQ without v1's zero offset,
    no longer reproduces the packers' weights."""
    awq, gptq = LAYERS["awq_g32"], LAYERS["gptq_4bit_asym_g64"]
    t_awq, t_gptq = load_file(str(FIXTURES / awq["file"])), load_file(str(FIXTURES / gptq["file"]))
    monkeypatch.setattr(reference, "AWQ_PACK_ORDER", tuple(range(8)))
    assert not torch.equal(dequantize(awq, t_awq).t(), t_awq["weight"])
    monkeypatch.undo()
    assert torch.equal(dequantize(awq, t_awq).t(), t_awq["weight"])
    ours = dequantize(gptq, t_gptq).t()
    off_by_one = ours + t_gptq["scales"].float()[t_gptq["g_idx"].long()].t()   # zero read as stored
    assert torch.equal(ours, t_gptq["weight"]) and not torch.equal(off_by_one, t_gptq["weight"])
    desc = LAYERS["gptq_4bit_asym_descact_g32"]
    t_desc = load_file(str(FIXTURES / desc["file"]))
    in_order = {**t_desc, "g_idx": torch.arange(desc["in_features"], dtype=torch.int32) // desc["group_size"]}
    assert not torch.equal(dequantize(desc, in_order).t(), t_desc["weight"])


@pytest.mark.parametrize("name", MODELS)
def test_packed_model_greedy_matches_hf_on_the_packers_weights(name, tmp_path):
    """The engine on the packer's checkpoint vs HF transformers on the packer's dequantized
    floats (same config minus quantization_config, same other tensors)."""
    case = MODELS[name]
    src = FIXTURES / case["dir"]
    quant_dir = tmp_path / "quant"
    quant_dir.mkdir()
    for f in ("config.json", "model.safetensors"):
        (quant_dir / f).write_bytes((src / f).read_bytes())
    copy_tokenizer(case["family"], quant_dir)
    dequantized = load_file(str(src / "dequantized.safetensors"))
    hf_dir = write_hf_twin(quant_dir, tmp_path / "hf", dequantized)
    llm = assert_greedy_matches_hf(quant_dir, hf_dir)
    # and the engine's projections hold exactly the packer's weights
    model = llm.engine.runner.model
    for layer, (module, part) in model.projections().items():
        lo, n = module.offsets[part], module.out_sizes[part]
        assert torch.equal(module.dense_weight()[lo:lo + n], dequantized[f"model.{layer}.weight"]), layer
