"""The CPU linear kernel (kernels/linear: a C kernel with the weight packed once in panels
of 32 columns) against F.linear, its packing kept in step with the weight, the cases it
leaves to F.linear, a machine without a compiler, and the engine's greedy output equal to
HF's on both paths."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from lockgate.engine import LLM, SamplingParams
from lockgate.engine.config import ModelConfig
from lockgate.engine.models import build_skeleton
from lockgate.engine.models.loader import packed_weight_bytes, tensor_bytes
from lockgate.kernels import linear as lin
from lockgate.kernels.cbuild import INCLUDE
from lockgate.kernels.linear import PackedWeight, cpu, implementation, linear
from lockgate.kernels.paged_attention import cpu as attention_cpu
from tests.support.helpers import demo_model, hf_greedy, random_prompts

needs_kernel = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the CPU linear kernel does not build")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 8, 33, 300])
# panels of 32 outputs with a partial last one (40, 70), K past one block of 512 (704, 1030)
@pytest.mark.parametrize(("n_in", "n_out"), [(24, 40), (256, 1408), (704, 256), (256, 8192), (1030, 70)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(rows, n_in, n_out, bias):
    g = torch.Generator().manual_seed(rows * 7 + n_in)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(n_out, n_in, generator=g) / n_in**0.5
    b = torch.randn(n_out, generator=g) if bias else None
    got = linear(x, w, b, PackedWeight())
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cpu.linear(x, cpu.pack(w), b, n_out), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_packed_layout_and_its_checks():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    packed = cpu.pack(w)
    assert packed.shape == (3, 3, cpu.PANEL) and packed.numel() == cpu.packed_numel(70, 3)
    assert torch.equal(packed[1, 2, :5], w[32:37, 2]) and torch.equal(packed[2, :, 6:], torch.zeros(3, 26))
    with pytest.raises(ValueError, match="does not fit"):
        cpu.linear(torch.randn(2, 4), packed, None, 70)          # K differs
    with pytest.raises(ValueError, match="does not fit"):
        cpu.linear(torch.randn(2, 3), packed, None, 100)         # more outputs than panels
    with pytest.raises(ValueError, match="float32 CPU weight"):
        cpu.pack(w.double())


@needs_kernel
def test_the_packed_weight_follows_the_weight():
    w = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)     # as the engine's are used
    x, packed = torch.randn(16, 32), PackedWeight()
    first = linear(x, w, None, packed)
    kept = packed.packed
    assert linear(x, w, None, packed) is not None and packed.packed is kept     # packed once
    with torch.no_grad():
        w.mul_(2)                                    # changed in place: packed again
    torch.testing.assert_close(linear(x, w, None, packed), 2 * first, rtol=1e-5, atol=1e-5)
    assert packed.packed is not kept
    w2 = torch.randn(64, 32)                         # another tensor: packed again
    torch.testing.assert_close(linear(x, w2, None, packed), F.linear(x, w2), rtol=1e-5, atol=1e-5)
    with torch.inference_mode():                     # inference tensors have no version
        w3 = torch.randn(64, 32)
        torch.testing.assert_close(linear(x, w3, None, PackedWeight()), F.linear(x, w3), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_which_calls_take_the_kernel(monkeypatch):
    small, head = torch.randn(256, 256), torch.randn(8192, 256)
    assert implementation(torch.randn(8, 256), small) == "cpu"
    assert implementation(torch.randn(1, 256), small) == "cpu"                # no fixed cost to amortize
    assert implementation(torch.randn(1, 256), head) == "cpu"
    assert implementation(torch.randn(0, 256), small) == "reference"          # nothing to do
    assert implementation(torch.randn(4, 0), torch.randn(8, 0)) == "reference"  # F.linear's zeros
    assert implementation(torch.randn(64, 256, dtype=torch.bfloat16), small.bfloat16()) == "reference"
    assert implementation(torch.randn(2, 32, 256), small) == "reference"      # 2-D inputs only
    monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    assert implementation(torch.randn(64, 256), small) == "reference"
    assert not lin.packs(torch.device("cpu"), torch.float32)


def test_without_the_kernel_every_call_is_f_linear(monkeypatch):
    """A machine where the kernel does not build (no compiler) still serves."""
    monkeypatch.setattr(cpu, "available", lambda: False)
    x, w = torch.randn(64, 256), torch.randn(512, 256)
    assert implementation(x, w) == "reference"
    assert torch.equal(linear(x, w, None, PackedWeight()), F.linear(x, w))
    assert not lin.packs(torch.device("cpu"), torch.float32)


@needs_kernel
def test_the_budget_counts_the_packed_copies(monkeypatch):
    skeleton = build_skeleton(ModelConfig.from_dir(demo_model("llama")), torch.float32)
    dense = sum(m.weight.numel() for m in skeleton.modules() if hasattr(m, "packed")) + skeleton.lm_head.weight.numel()
    assert packed_weight_bytes(skeleton, torch.device("cpu"), torch.float32) == 4 * dense
    assert 0 < 4 * dense < tensor_bytes(skeleton)
    assert packed_weight_bytes(skeleton, torch.device("cpu"), torch.bfloat16) == 0
    monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    assert packed_weight_bytes(skeleton, torch.device("cpu"), torch.float32) == 0


@pytest.mark.parametrize("kernels", ["default", "reference"])
def test_engine_greedy_equals_hf_on_both_paths(kernels, monkeypatch):
    if kernels == "reference":
        monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    d = demo_model("llama")
    prompts = random_prompts(d, [3, 17, 40, 90, 130, 200, 257, 9, 64, 33], seed=5)
    lens = [12, 20, 7, 16, 9, 14, 10, 18, 6, 11]
    llm = LLM(d)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=n, temperature=0.0) for n in lens], use_progress_bar=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(d, p, n) for p, n in zip(prompts, lens, strict=True)]


@needs_kernel
def test_calls_the_kernel_cannot_serve_exactly_take_f_linear():
    w, x = torch.randn(256, 256), torch.randn(64, 256)
    # a gradient wanted: the kernel has no backward
    wg = torch.randn(256, 256, requires_grad=True)
    assert implementation(x, wg) == "reference"
    y = linear(x, wg, None, PackedWeight())
    y.sum().backward()
    assert wg.grad is not None
    with torch.no_grad():
        assert implementation(x, wg) == "cpu"
    # an inference tensor can change in place with no version to show it: never packed
    with torch.inference_mode():
        wi = torch.randn(256, 256)
    assert implementation(x, wi) == "reference"
    # a bias that is not float32: F.linear's own rules; a strided one: made contiguous
    assert implementation(x, w, torch.randn(256, dtype=torch.float64)) == "reference"
    strided = torch.randn(512)[::2]
    torch.testing.assert_close(linear(x, w, strided, PackedWeight()), F.linear(x, w, strided), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_a_new_tensor_at_the_same_address_is_packed_again():
    x, packed = torch.randn(16, 32), PackedWeight()
    storage = torch.randn(64, 32)
    a = storage.view(64, 32)
    linear(x, a, None, packed)
    b = storage.view(64, 32)           # same storage, same version, another tensor
    with torch.no_grad():
        storage.copy_(torch.randn(64, 32))
    torch.testing.assert_close(linear(x, b, None, packed), F.linear(x, b), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
@pytest.mark.parametrize(("n_in", "inter"), [(256, 704), (40, 24), (600, 50)])
def test_gate_up_in_pairs_serves_the_product_and_the_fused_activation(rows, n_in, inter):
    """A [gate; up] weight packed in pairs (each half padded to whole panels when inter is
    not a multiple of 32; K past one block of 512): `linear` gives F.linear's product, and
    the fused op the SiLU-and-mul of it."""
    from lockgate.kernels.linear import gate_up_silu_mul
    from lockgate.kernels.pointwise.reference import silu_mul

    g = torch.Generator().manual_seed(rows + inter)
    x, w = torch.randn(rows, n_in, generator=g), torch.randn(2 * inter, n_in, generator=g) / n_in**0.5
    packed = PackedWeight(pairs_of=inter)
    torch.testing.assert_close(linear(x, w, None, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert packed.packed.numel() == cpu.packed_numel(2 * inter, n_in, inter)
    fused = gate_up_silu_mul(x, w, packed)
    torch.testing.assert_close(fused, silu_mul(F.linear(x, w)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        cpu.linear_silu_mul(x, packed.packed, inter + 32)
    with pytest.raises(ValueError, match="2 x"):
        cpu.pack(w[1:], pairs_of=inter)


def test_the_fused_activation_steps_aside_where_the_kernel_does_not_run(monkeypatch):
    """Not packed in pairs, a gradient wanted, or LOCKGATE_KERNELS=reference: None, and the
    model projects and applies the activation itself."""
    from lockgate.kernels.linear import gate_up_silu_mul

    x, w = torch.randn(8, 32), torch.randn(64, 32)
    assert gate_up_silu_mul(x, w, PackedWeight()) is None
    assert gate_up_silu_mul(x, torch.randn(64, 32, requires_grad=True), PackedWeight(pairs_of=32)) is None
    monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    assert gate_up_silu_mul(x, w, PackedWeight(pairs_of=32)) is None


def test_without_a_compiler_the_projections_run_f_linear(monkeypatch, tmp_path, caplog):
    """A machine with no C compiler still serves: the projections answer through F.linear, the
    fused gate/up steps aside (the model applies SiLU-and-mul itself), the budget counts no
    packed copies."""
    import logging

    from lockgate.kernels.linear import gate_up_silu_mul

    monkeypatch.setattr(cpu.KERNEL, "lib", None)
    monkeypatch.setattr(cpu.KERNEL, "tried", False)
    monkeypatch.setenv("LOCKGATE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    x, w = torch.randn(5, 32), torch.randn(64, 32)
    with caplog.at_level(logging.WARNING, logger="lockgate.kernels.cbuild"):
        assert torch.equal(linear(x, w, None, PackedWeight()), F.linear(x, w))
    assert "no C compiler found" in caplog.text
    assert gate_up_silu_mul(x, w, PackedWeight(pairs_of=32)) is None
    assert not lin.packs(torch.device("cpu"), torch.float32)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                    reason="x86 vector widths, built with the machine's C compiler")
@pytest.mark.parametrize("source", [cpu.SOURCE, attention_cpu.PREFILL_SOURCE], ids=["linear", "prefill_attention"])
@pytest.mark.parametrize(("march", "register", "absent"), [("x86-64-v3", "%ymm", "%zmm"), ("x86-64-v4", "%zmm", None)])
def test_vectors_as_wide_as_the_targets_registers(tmp_path, source, march, register, absent):
    """The register-tiled kernels (the linear and the prefill attention) build without a
    warning for AVX2 and for AVX-512 whichever this machine is, and each build's arithmetic
    runs in that target's registers: vectors wider than the registers are lowered through
    the stack (AVX-512-shaped tiles built for AVX2 read a spilled operand at every packed
    multiply-add, and the linear ran ~25x slower than sgemm on an AVX2 machine)."""
    asm = tmp_path / "kernel.s"
    done = subprocess.run(["cc", "-O3", f"-march={march}", "-fopenmp", "-std=c11", "-Wall", "-Werror",
                           f"-I{INCLUDE}", "-S", str(source), "-o", str(asm)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    text = asm.read_text()
    # the packed multiply-adds: in the target's registers, hardly any reading a spilled operand
    # from the stack (the AVX-512-shaped builds for AVX2: 479 of 480, 160 of 160)
    fmas = [line for line in text.splitlines() if "vfmadd" in line and "ps\t" in line and "xmm" not in line]
    assert len(fmas) >= 24 and all(register in line for line in fmas), fmas[:5]
    spilled = [line for line in fmas if "(%rsp)" in line]
    assert len(spilled) <= 0.05 * len(fmas), spilled[:5]
    if absent:
        assert absent not in text
