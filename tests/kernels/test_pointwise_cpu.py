"""The CPU pointwise kernel (kernels/pointwise/cpu.py) against the plain-torch reference:
the residual add with RMSNorm, and the rotary embedding with the K/V cache write."""

from __future__ import annotations

import pytest
import torch

import lockgate.kernels.pointwise as pointwise
from lockgate.kernels.pointwise import cpu, reference

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler: the reference path is the CPU path")


@pytest.mark.parametrize("rows", [1, 5, 33, 300])
@pytest.mark.parametrize("hidden", [13, 256, 4099])
@pytest.mark.parametrize("with_x", [True, False])
def test_add_rms_norm_matches_the_reference(rows, hidden, with_x):
    g = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=g) if with_x else None
    res = torch.randn(rows, hidden, generator=g) * 3
    w = torch.randn(hidden, generator=g)
    res_ref = res.clone()
    want = reference.add_rms_norm(x, res_ref, w, 1e-5)
    got = cpu.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(res, res_ref)          # the add: elementwise, bit for bit
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)   # the mean sums in another order


def _rope_case(rows, heads, kv_heads, d, num_blocks=40, block_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g)
    angle = torch.rand(rows, 1, d, generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()
    kc = torch.randn(kv_heads, num_blocks, block_size, d, generator=g)
    vc = torch.randn_like(kc)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:rows]
    return qkv, cos, sin, kc, vc, slots


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(4, 2, 64), (3, 3, 8), (8, 1, 128), (6, 2, 80)])
def test_rope_write_kv_is_the_reference_bit_for_bit(rows, heads, kv_heads, d):
    qkv, cos, sin, kc, vc, slots = _rope_case(rows, heads, kv_heads, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = reference.rope_write_kv(qkv, heads, kv_heads, cos, sin, kc_ref, vc_ref, slots)
    got = cpu.rope_write_kv(qkv, heads, kv_heads, cos, sin, kc, vc, slots)
    assert torch.equal(got, want)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_a_slot_outside_the_cache_is_refused_and_nothing_is_written():
    qkv, cos, sin, kc, vc, slots = _rope_case(5, 4, 2, 16)
    before_k, before_v = kc.clone(), vc.clone()
    for bad in (kc.shape[1] * kc.shape[2], -1):
        slots[3] = bad
        with pytest.raises(ValueError, match="slot outside the cache"):
            cpu.rope_write_kv(qkv, 4, 2, cos, sin, kc, vc, slots)
        assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


def test_bad_arguments_are_clear_errors():
    qkv, cos, sin, kc, vc, slots = _rope_case(5, 4, 2, 16)
    with pytest.raises(ValueError, match="does not hold"):
        cpu.rope_write_kv(qkv, 3, 2, cos, sin, kc, vc, slots)
    with pytest.raises(ValueError, match="int64"):
        cpu.rope_write_kv(qkv, 4, 2, cos, sin, kc, vc, slots.int())
    with pytest.raises(ValueError, match="float32 only"):
        cpu.add_rms_norm(None, torch.randn(3, 8).double(), torch.randn(8).double(), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        cpu.add_rms_norm(None, torch.randn(3, 8), torch.randn(9), 1e-5)


def test_dispatch_takes_the_kernel_only_where_it_serves(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "add_rms_norm", lambda *a: calls.append("cpu") or reference.add_rms_norm(*a))
    w = torch.ones(8)
    pointwise.add_rms_norm(None, torch.randn(2, 8), w, 1e-5)
    assert calls == ["cpu"]
    pointwise.add_rms_norm(None, torch.randn(2, 8).bfloat16(), w.bfloat16(), 1e-5)   # half: reference
    wg = torch.ones(8, requires_grad=True)
    out = pointwise.add_rms_norm(None, torch.randn(2, 8), wg, 1e-5)                  # a gradient: reference
    out.sum().backward()
    assert wg.grad is not None
    monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    pointwise.add_rms_norm(None, torch.randn(2, 8), w, 1e-5)
    assert calls == ["cpu"]


@pytest.mark.parametrize("rows", [1, 9, 64, 300])
@pytest.mark.parametrize("inter", [5, 704, 1031])
def test_silu_mul_matches_the_reference(rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 4
    gate_up[0, :5] = torch.tensor([-100.0, -87.5, 0.0, 30.0, 95.0])[:min(5, inter)]
    want = reference.silu_mul(gate_up)
    got = cpu.silu_mul(gate_up)
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got, want, rtol=3e-6, atol=1e-30)    # e^-x within 2 ulp of expf


def test_silu_mul_refuses_an_odd_width():
    with pytest.raises(ValueError, match="2 \\* inter"):
        cpu.silu_mul(torch.randn(3, 7))


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 7), (64, 8192), (5, 100_003)])
def test_argmax_rows_is_torchs_argmax(rows, cols):
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(rows, cols, generator=g)
    assert torch.equal(cpu.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_ties_infinities_and_nans_as_torch():
    x = torch.tensor([
        [1.0, 3.0, 3.0, 2.0],                                  # a tie: the first
        [float("-inf")] * 4,                                   # all -inf: index 0
        [0.0, float("inf"), 5.0, float("inf")],                # +inf, twice
        [1.0, float("nan"), 9.0, float("nan")],                # a NaN wins, the first
        [-2.0, -1.0, -1.0, -3.0],
    ])
    assert torch.equal(cpu.argmax_rows(x), x.argmax(dim=-1))
    with pytest.raises(ValueError, match="cols >= 1"):
        cpu.argmax_rows(torch.empty(2, 0))


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 33, 100, 8192])
def test_argmax_rows_with_many_ties_picks_the_first(cols):
    """Values from a handful of integers: the max recurs across vector lanes and in the tail,
    and the first index must win wherever it lies."""
    g = torch.Generator().manual_seed(cols)
    x = torch.randint(0, 4, (50, cols), generator=g).float()
    x[0, -1] = 9.0                   # the max only in the tail
    if cols > 20:
        x[1, :] = 0.0
        x[1, 20] = x[1, 35 % cols] = 5.0   # lanes 4 and 3: the lower index wins, not the lower lane
    assert torch.equal(cpu.argmax_rows(x), x.argmax(dim=-1))


def test_without_a_compiler_the_model_ops_run_the_reference(monkeypatch, tmp_path, caplog):
    """A machine with no C compiler still serves: each op answers through the reference."""
    import logging

    monkeypatch.setattr(cpu.KERNEL, "lib", None)
    monkeypatch.setattr(cpu.KERNEL, "tried", False)
    monkeypatch.setenv("LOCKGATE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    res, x, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    want = reference.add_rms_norm(x, res.clone(), w, 1e-5)
    with caplog.at_level(logging.WARNING, logger="lockgate.kernels.cbuild"):
        got = pointwise.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(got, want) and "no C compiler found" in caplog.text
    assert torch.equal(pointwise.argmax_rows(x), x.argmax(dim=-1))
