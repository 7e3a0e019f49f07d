"""kernels/quant/triton.py (the fused W4A16 GEMM, AWQ GEMM and GPTQ v1 layouts) against the
plain-torch reference, on CPU tensors under Triton's interpreter.

Triton reads TRITON_INTERPRET when first imported: tests/kernels/conftest.py sets it to 1
unless the environment says otherwise; with TRITON_INTERPRET=0 (a CUDA machine) the same
tests run compiled, on the GPU.

Tolerance: the kernel dequantizes to exactly the reference's W (in the scales' dtype, then
x's) and accumulates in fp32; it differs from the reference by summation order and by
rounding y once where the reference rounds x @ W and then (+ bias) again. In bfloat16 the
interpreter also rounds conversions by truncation. So |y - ref| <= tol * max|ref| (and
rtol tol) with tol 1e-5 (fp32), 2e-3 (fp16, ~2 ulp), 2e-2 (bf16, ~2 ulp). Every launch here
has at most 64 programs (M <= 33 rows in one tile, N <= 72 in two).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import lockgate.kernels.quant as quant_pkg
from lockgate.engine.quant import AWQConfig, AWQLinear, GPTQConfig, GPTQLinear
from lockgate.kernels.quant import reference

pytest.importorskip("triton")
from lockgate.kernels.quant import bench
from lockgate.kernels.quant import triton as fused
from tests.kernels.device import DEVICE, needs_device

needs_device()
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "quant"
MANIFEST = json.loads((FIXTURES / "MANIFEST.json").read_text())
LAYERS = {k: v for k, v in MANIFEST["cases"].items() if v["kind"] == "layer"}


def assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape
    tol = TOL[ref.dtype]
    scale = max(ref.float().abs().max().item(), 1e-3)
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * scale)


def awq_tensors(K: int, N: int, group: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = K // group
    codes = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, N), generator=g, dtype=torch.int32)
    scales = (torch.rand(groups, N, generator=g) * 0.02 + 0.001).to(dtype)
    return tuple(t.to(DEVICE) for t in (reference.awq_pack(codes), reference.awq_pack(zeros), scales))


def gptq_tensors(K: int, N: int, group: int, bits: int, dtype: torch.dtype, shuffled: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = -(-K // group)
    codes = torch.randint(0, 2**bits, (K, N), generator=g, dtype=torch.int32)
    stored_zeros = torch.randint(0, 2**bits, (groups, N), generator=g, dtype=torch.int32)   # v1: zero - 1
    scales = (torch.rand(groups, N, generator=g) * 0.02 + 0.001).to(dtype)
    g_idx = torch.arange(K, dtype=torch.int32) // group
    if shuffled:   # act-order: the input channels' groups in a permuted order
        g_idx = g_idx[torch.randperm(K, generator=g)]
        assert g_idx.tolist() != sorted(g_idx.tolist())
    packed = (reference.pack_int32(codes, bits, 0), reference.pack_int32(stored_zeros, bits, 1), scales, g_idx)
    return tuple(t.to(DEVICE) for t in packed)


def activations(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def bias_for(N: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


# (group size, number of groups, N): 2-3 groups along K, N a multiple of 8 but not of BLOCK_N
SHAPES = [(32, 3, 40), (64, 2, 72), (128, 3, 40)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 3, 17, 33])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"g{s[0]}x{s[1]}-n{s[2]}")
def test_awq_matches_reference(shape, M, dtype):
    group, groups, N = shape
    K = group * groups
    qweight, qzeros, scales = awq_tensors(K, N, group, dtype, seed=M + group)
    x = activations((M, K), dtype, seed=M)
    bias = bias_for(N, dtype, seed=N)
    assert_matches(fused.awq_matmul(x, qweight, qzeros, scales, group, bias),
                   reference.awq_matmul(x, qweight, qzeros, scales, group, bias))
    assert_matches(fused.awq_matmul(x, qweight, qzeros, scales, group),
                   reference.awq_matmul(x, qweight, qzeros, scales, group))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 3, 17, 33])
@pytest.mark.parametrize("order", ["sorted", "act-order"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"g{s[0]}x{s[1]}-n{s[2]}")
def test_gptq_4bit_matches_reference(shape, order, M, dtype):
    group, groups, N = shape
    K = group * groups
    qweight, qzeros, scales, g_idx = gptq_tensors(K, N, group, 4, dtype, order == "act-order", seed=M + group)
    x = activations((M, K), dtype, seed=M)
    bias = bias_for(N, dtype, seed=N) if (M + group) % 3 else None
    assert_matches(fused.gptq_matmul(x, qweight, qzeros, scales, g_idx, 4, bias),
                   reference.gptq_matmul(x, qweight, qzeros, scales, g_idx, 4, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("order", ["sorted", "act-order"])
def test_gptq_8bit_and_a_partial_last_group(order, dtype):
    """8-bit codes (4 to a word), and K = 160 with group 64: the last group is half full."""
    qweight, qzeros, scales, g_idx = gptq_tensors(160, 72, 64, 8, dtype, order == "act-order", seed=8)
    x = activations((5, 160), dtype, seed=5)
    bias = bias_for(72, dtype, seed=1)
    assert_matches(fused.gptq_matmul(x, qweight, qzeros, scales, g_idx, 8, bias),
                   reference.gptq_matmul(x, qweight, qzeros, scales, g_idx, 8, bias))
    q4 = gptq_tensors(160, 72, 64, 4, dtype, order == "act-order", seed=4)
    assert_matches(fused.gptq_matmul(x, *q4, 4), reference.gptq_matmul(x, *q4, 4))


@pytest.mark.parametrize("tiles", [
    fused.Tiles(16, 32, 32, 1),    # AWQ group 64 > BLOCK_K: two K tiles per group
    fused.Tiles(16, 32, 128, 1),   # BLOCK_K straddles groups: AWQ looks the group up per row
    fused.Tiles(16, 16, 16, 4),    # K split over 4 programs, fp32 partials summed (bias once)
    fused.Tiles(32, 64, 64, 3),    # 3 splits over 3 K tiles, a 32-row M tile
], ids=["bk32", "bk128-per-row", "split4", "split3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_tilings_and_split_k(tiles, dtype):
    K, N, group = 192, 40, 64
    x = activations((7, K), dtype, seed=3)
    bias = bias_for(N, dtype, seed=2)
    awq = awq_tensors(K, N, group, dtype, seed=11)
    assert_matches(fused.awq_launch(x, *awq, group, bias, tiles=tiles), reference.awq_matmul(x, *awq, group, bias))
    gptq = gptq_tensors(K, N, group, 4, dtype, True, seed=12)
    assert_matches(fused.gptq_launch(x, *gptq, 4, bias, tiles=tiles), reference.gptq_matmul(x, *gptq, 4, bias))


def test_leading_dims_strided_views_and_mixed_dtypes():
    """x [..., K] of any leading shape, non-contiguous x and weight views (a fused part's slice
    of the buffers), fp16 scales and an fp32 bias under bf16 activations: all as the reference."""
    K, N, group = 128, 48, 32
    qweight, qzeros, scales = awq_tensors(K, 2 * N, group, torch.float16, seed=21)
    part = (qweight[:, N // 8:], qzeros[:, N // 8:], scales[:, N:])        # the second part, strided
    assert not part[0].is_contiguous()
    x = activations((2, 3, K), torch.bfloat16, seed=22)
    bias = bias_for(N, torch.float32, seed=23)
    assert_matches(fused.awq_matmul(x, *part, group, bias), reference.awq_matmul(x, *part, group, bias))
    xt = activations((K, 5), torch.float16, seed=24).t()                    # strided rows
    assert_matches(fused.awq_matmul(xt, *part, group), reference.awq_matmul(xt, *part, group))
    qw, qz, s, g_idx = gptq_tensors(K, 2 * N, group, 4, torch.float16, True, seed=25)
    gpart = (qw[:, N:], qz[:, N // 8:], s[:, N:], g_idx.long())               # int64 g_idx too
    assert_matches(fused.gptq_matmul(x, *gpart, 4, bias), reference.gptq_matmul(x, *gpart, 4, bias))
    empty = x[:, :0]
    assert fused.gptq_matmul(empty, *gpart, 4).shape == (2, 0, N)


def test_bad_arguments_are_refused():
    qweight, qzeros, scales, g_idx = gptq_tensors(64, 16, 32, 4, torch.float16, False, seed=0)
    x = activations((2, 64), torch.float16, seed=0)
    with pytest.raises(ValueError, match="bits"):
        fused.gptq_matmul(x, qweight, qzeros, scales, g_idx, 3)
    with pytest.raises(ValueError, match="x must be"):
        fused.gptq_matmul(x.double(), qweight, qzeros, scales, g_idx, 4)
    with pytest.raises(ValueError, match="input features"):
        fused.gptq_matmul(x[:, :32], qweight, qzeros, scales, g_idx, 4)
    awq = awq_tensors(64, 16, 32, torch.float16, seed=0)
    with pytest.raises(ValueError, match="group_size"):
        fused.awq_matmul(x, *awq, 48)


@pytest.mark.parametrize("name", LAYERS)
def test_golden_fixtures(name):
    """The AutoAWQ / AutoGPTQ packed layers: the kernel on their tensors equals F.linear on
    the weight the packer says they hold (fp32 activations, the checkpoint's fp16 scales) and
    the reference (fp16 activations)."""
    case = LAYERS[name]
    t = load_file(str(FIXTURES / case["file"]), device=str(DEVICE))
    x = activations((5, case["in_features"]), torch.float32, seed=0)
    bias = t.get("bias")
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        if case["method"] == "awq":
            args = (t["qweight"], t["qzeros"], t["scales"], case["group_size"], bias)
            y, ref = fused.awq_matmul(xd, *args), reference.awq_matmul(xd, *args)
        else:
            args = (t["qweight"], t["qzeros"], t["scales"], t["g_idx"], case["bits"], bias)
            y, ref = fused.gptq_matmul(xd, *args), reference.gptq_matmul(xd, *args)
        assert_matches(y, ref)
        if dtype == torch.float32:
            golden = F.linear(x, t["weight"].half().float(), None if bias is None else bias.float())
            torch.testing.assert_close(y, golden, rtol=1e-5, atol=1e-5)


def test_dispatch_follows_lockgate_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(fused, "awq_matmul", lambda *a: calls.append("awq") or reference.awq_matmul(*a))
    monkeypatch.setattr(fused, "gptq_matmul", lambda *a: calls.append("gptq") or reference.gptq_matmul(*a))
    x = activations((2, 64), torch.float32, seed=0)
    awq = awq_tensors(64, 16, 32, torch.float32, seed=0)
    gptq = gptq_tensors(64, 16, 32, 4, torch.float32, False, seed=0)
    if DEVICE.type == "cpu":
        monkeypatch.delenv("LOCKGATE_KERNELS", raising=False)
        quant_pkg.awq_matmul(x, *awq, 32)
        quant_pkg.gptq_matmul(x, *gptq, 4)
        assert calls == []                   # CPU tensors: the reference, unless asked
    monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    quant_pkg.awq_matmul(x, *awq, 32)
    quant_pkg.gptq_matmul(x, *gptq, 4)
    assert calls == []
    monkeypatch.setenv("LOCKGATE_KERNELS", "triton")
    quant_pkg.awq_matmul(x, *awq, 32)
    quant_pkg.gptq_matmul(x, *gptq, 4)
    assert calls == ["awq", "gptq"]


@pytest.mark.parametrize("name", ["awq_g64", "gptq_4bit_asym_descact_g32", "gptq_8bit_sym_g32"])
def test_engine_projection_on_the_triton_path(name, monkeypatch):
    """AWQLinear / GPTQLinear with two fused parts (the fixture's tensors twice, the second
    GPTQ part with a reversed g_idx) in fp16: LOCKGATE_KERNELS=triton matches the reference path."""
    case = LAYERS[name]
    t = load_file(str(FIXTURES / case["file"]))
    n_in, n_out = case["in_features"], case["out_features"]
    with torch.device("meta"):
        if case["method"] == "awq":
            module = AWQLinear(n_in, [n_out, n_out], True, AWQConfig(case["group_size"]))
        else:
            config = GPTQConfig(case["bits"], case["group_size"], case["desc_act"], case["sym"])
            module = GPTQLinear(n_in, [n_out, n_out], True, config)
    module = module.to_empty(device=DEVICE).to(torch.float16)
    for part in (0, 1):
        for key in module.specs:
            tensor = t[key].to(DEVICE) if key != "bias" else bias_for(n_out, torch.float16, seed=part)
            module.load_part(part, key, tensor)
    if case["method"] == "gptq":
        module.g_idx[1] = module.g_idx[1].flip(0)
    x = activations((3, 4, n_in), torch.float16, seed=1)
    monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    want = module(x)
    monkeypatch.setenv("LOCKGATE_KERNELS", "triton")
    assert_matches(module(x), want)


def test_bench_cases_quick_smoke():
    cases = bench.cases(DEVICE, torch.float16, quick=True)
    assert {c.name.split()[0] for c in cases} == {"awq", "gptq"}
    assert {c.bound for c in cases} == {"memory", "compute"}
    for case in cases:
        assert case.kernel == "w4a16" and case.baseline == "torch.matmul on the dequantized weight"
        assert case.bytes_moved > 0 and case.flops > 0
        y, ref = case.triton(), case.reference()
        assert isinstance(y, torch.Tensor) and isinstance(ref, torch.Tensor)
        assert_matches(y, ref)
