"""kernels/lora/triton.py (BGMV and SGMV shrink/expand) against the plain-torch reference,
on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, the default here), or compiled
on CUDA tensors with TRITON_INTERPRET=0 (scripts/device-check.sh): DEVICE,
tests/kernels/device.py. Inputs come from CPU generators; the reference runs on them on the
CPU, the kernels on DEVICE copies, and the results are compared on the CPU.

Tolerances: the expected values are the reference run in float32 on the same (rounded)
inputs; float32 within rtol = atol = 1e-4, float16 within 2e-3 and bfloat16 within 1.6e-2
relative (a couple of roundings of the output at those precisions) with atol 2e-2 / 2e-3
for values near zero. Outputs the kernels must not touch (tokens without an adapter,
columns outside the out slice, rows outside every segment) are compared bit for bit.

Under the interpreter every launch is capped at 64 programs (it runs them one after
another): the `launches` fixture wraps the kernels' one launch point and checks each grid
(on a GPU it only records them: there the shrink splits its reduction to fill the device).
"""

from __future__ import annotations

import dataclasses
import math
import os

# before triton is imported anywhere: its kernels then run in the interpreter, on CPU tensors
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")

import lockgate.kernels.lora as lora_pkg
from lockgate.kernels.dispatch import KernelUnavailable
from lockgate.kernels.lora import reference
from lockgate.kernels.lora import triton as tk
from tests.kernels.device import DEVICE, needs_device

needs_device()

MAX_PROGRAMS = 64
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 2e-2)}


@pytest.fixture(autouse=True)
def launches(monkeypatch):
    """Records every kernel launch's grid and fails one above MAX_PROGRAMS programs."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    launch = tk._launch

    def counting(kernel, grid, *args, **meta):
        if DEVICE.type == "cpu":        # the interpreter: programs one by one
            assert math.prod(grid) <= MAX_PROGRAMS, f"{kernel.__name__} launched {grid}"
        seen.append((kernel.__name__, grid))
        launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(tk, "_launch", counting)
    monkeypatch.delenv("LOCKGATE_KERNELS", raising=False)
    return seen


def make_slots(num_slots, ranks, r_max, in_f, out_f, g, dtype):
    """lora_a [slots, r_max, in] and lora_b [slots, out, r_max], adapter s of rank ranks[s]
    zero-padded up to r_max (rank 0: an empty slot)."""
    a = torch.zeros(num_slots, r_max, in_f)
    b = torch.zeros(num_slots, out_f, r_max)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=g) / in_f ** 0.5
        b[s, :, :r] = torch.randn(out_f, r, generator=g) / max(r, 1) ** 0.5
    return a.to(dtype), b.to(dtype)


def on_device(*tensors):
    """The tensors on DEVICE (on the CPU: the same tensors, views included)."""
    return tuple(t.to(DEVICE) for t in tensors)


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# (T, in, out, r_max, ranks of the slots): odd sizes, none a multiple of a block
SHAPES = [
    (1, 40, 72, 8, [8, 8, 8]),
    (17, 72, 100, 16, [16, 5, 0, 16]),   # mixed ranks padded to r_max, slot 2 empty
    (33, 100, 40, 64, [64, 33, 64]),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("T", "in_f", "out_f", "r_max", "ranks"), SHAPES)
def test_bgmv_lora_shrink_expand_matches_reference(T, in_f, out_f, r_max, ranks, dtype):
    g = torch.Generator().manual_seed(T * 1000 + in_f)
    n = len(ranks)
    a, b = make_slots(n, ranks, r_max, in_f, out_f, g, dtype)
    big = torch.randn(T, in_f + 5, generator=g).to(dtype)
    x = big[:, 3:3 + in_f]                           # a strided view
    lo = 7
    out0 = torch.randn(T, lo + out_f + 9, generator=g).to(dtype)   # a fused output, our slice in the middle
    slots = torch.randint(-1, n, (T,), generator=g)
    if T > 1:
        slots[0] = -1
    scaling = torch.tensor([0.5, 2.0, 1.0, 0.25][:n])
    want = reference.lora_shrink_expand(x.float(), out0.float().clone(), a.float(), b.float(), slots, scaling,
                                        (lo, lo + out_f))
    out = out0.to(DEVICE, copy=True)
    x_dev = big.to(DEVICE)[:, 3:3 + in_f]            # the same strided view, on DEVICE
    ret = tk.lora_shrink_expand(x_dev, out, *on_device(a, b, slots, scaling), (lo, lo + out_f))
    assert ret is out
    out = out.cpu()
    close(out, want, dtype)
    # no adapter, or outside the slice: untouched, bit for bit
    assert torch.equal(out[slots == -1], out0[slots == -1])
    assert torch.equal(out[:, :lo], out0[:, :lo]) and torch.equal(out[:, lo + out_f:], out0[:, lo + out_f:])
    # against the reference in the native dtype as well (it rounds its intermediates)
    native = reference.lora_shrink_expand(x, out0.clone(), a, b, slots, scaling, (lo, lo + out_f))
    close(out, native, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("T", "in_f", "out_f", "r_max", "ranks"), SHAPES)
def test_sgmv_matches_reference(T, in_f, out_f, r_max, ranks, dtype):
    g = torch.Generator().manual_seed(T * 1000 + out_f)
    n = len(ranks)
    a, b = make_slots(n, ranks, r_max, in_f, out_f, g, dtype)
    bt = b.transpose(1, 2).contiguous()
    x = torch.randn(T, in_f, generator=g).to(dtype)
    out0 = torch.randn(T, out_f + 20, generator=g).to(dtype)
    # uneven segments, base-model (-1) ones, an empty one, the last rows in none
    cuts = {1: [0, 1], 17: [0, 3, 3, 4, 12, 16], 33: [0, 2, 19, 20, 31, 33]}[T]
    pattern = [1, -1, 0, n - 1, 0]
    seg_slots = pattern[:len(cuts) - 1]
    scales = [0.5, 2.0, 1.0, 0.25][:n]
    want = reference.sgmv(x.float(), out0.float().clone(), a.float(), bt.float(), cuts, seg_slots, scales,
                          (20, 20 + out_f))
    out = out0.to(DEVICE, copy=True)
    ret = tk.sgmv(*on_device(x), out, *on_device(a, bt), cuts, seg_slots, scales, (20, 20 + out_f))
    assert ret is out
    out = out.cpu()
    close(out, want, dtype)
    assert torch.equal(out[:, :20], out0[:, :20])
    for i, s in enumerate(seg_slots):
        if s < 0:
            assert torch.equal(out[cuts[i]:cuts[i + 1]], out0[cuts[i]:cuts[i + 1]])
    assert torch.equal(out[cuts[-1]:], out0[cuts[-1]:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shrink_and_expand_separately(dtype):
    """lora_shrink / lora_expand, per token and per segment, against plain matmuls."""
    g = torch.Generator().manual_seed(5)
    T, in_f, out_f, r_max = 17, 72, 40, 16
    a, b = make_slots(3, [16, 8, 16], r_max, in_f, out_f, g, dtype)
    bt = b.transpose(1, 2).contiguous()
    x = torch.randn(T, in_f, generator=g).to(dtype)
    seg_starts, seg_slots = [0, 4, 9, 9, 17], [2, -1, 1, 0]
    per_token = torch.cat([torch.full((seg_starts[i + 1] - seg_starts[i],), s) for i, s in enumerate(seg_slots)])
    scales = [0.5, 2.0, 1.5]
    want_shrunk = torch.zeros(T, r_max)
    for t in range(T):
        if per_token[t] >= 0:
            want_shrunk[t] = x[t].float() @ a[per_token[t]].float().T
    rtol, atol = TOL[dtype]
    x_dev, a_dev, bt_dev, per_token_dev = on_device(x, a, bt, per_token)
    for shrunk in (tk.lora_shrink(x_dev, a_dev, per_token_dev),
                   tk.lora_shrink(x_dev, a_dev, segments=(seg_starts, seg_slots))):
        assert shrunk.dtype == torch.float32 and shrunk.shape == (T, r_max) and shrunk.device == x_dev.device
        torch.testing.assert_close(shrunk.cpu(), want_shrunk, rtol=rtol, atol=atol)
        assert torch.equal(shrunk.cpu()[4:9], torch.zeros(5, r_max))
    out0 = torch.randn(T, out_f, generator=g).to(dtype)
    want = out0.float().clone()
    for t in range(T):
        s = int(per_token[t])
        if s >= 0:
            want[t] += scales[s] * (want_shrunk[t] @ bt[s].float())
    shrunk_dev, scales_dev = on_device(want_shrunk, torch.tensor(scales))
    got_b = tk.lora_expand(shrunk_dev, out0.to(DEVICE, copy=True), bt_dev, scales_dev, per_token_dev)
    got_s = tk.lora_expand(shrunk_dev, out0.to(DEVICE, copy=True), bt_dev, scales, segments=(seg_starts, seg_slots))
    close(got_b.cpu(), want, dtype)
    close(got_s.cpu(), want, dtype)
    with pytest.raises(ValueError):
        tk.lora_shrink(x_dev, a_dev)


def test_no_adapter_anywhere_leaves_out_untouched(launches):
    g = torch.Generator().manual_seed(6)
    a, b = on_device(*make_slots(2, [8, 8], 8, 40, 24, g, torch.float32))
    x = torch.randn(17, 40, generator=g).to(DEVICE)
    out0 = torch.randn(17, 24, generator=g).to(DEVICE)
    out = out0.clone()
    ones = torch.ones(2, device=DEVICE)
    tk.lora_shrink_expand(x, out, a, b, torch.full((17,), -1, device=DEVICE), ones)
    assert torch.equal(out, out0)
    tk.sgmv(x, out, a, b.transpose(1, 2), [0, 5, 17], [-1, -1], [1.0, 1.0])
    assert torch.equal(out, out0)
    assert not any(name.startswith("_sgmv") for name, _ in launches)   # segments of -1: nothing to launch
    # empty batch, empty slice
    tk.lora_shrink_expand(torch.empty(0, 40, device=DEVICE), torch.empty(0, 24, device=DEVICE), a, b,
                          torch.empty(0, dtype=torch.int64, device=DEVICE), ones)
    tk.lora_shrink_expand(x, out, a, b[:, :0], torch.zeros(17, dtype=torch.int64, device=DEVICE), ones, (3, 3))
    assert torch.equal(out, out0)


def test_fused_qkv_slices_like_the_engine():
    """The engine's fused layout: lora_a [slots, 3 * r, in] (q, k, v rank rows stacked) and a
    block-diagonal lora_bt [slots, 3 * r, q + 2 kv], applied by one sgmv; and the same
    deltas as three per-part calls into the q, k and v slices."""
    g = torch.Generator().manual_seed(8)
    T, hidden, q, kv, r = 33, 40, 40, 24, 8
    total = q + 2 * kv
    parts = [make_slots(3, [8, 4, 8], r, hidden, size, g, torch.float32) for size in (q, kv, kv)]
    a_fused = torch.cat([a for a, _ in parts], dim=1)
    bt_fused = torch.zeros(3, 3 * r, total)
    offsets = [0, q, q + kv, total]
    for p, (_, b) in enumerate(parts):
        bt_fused[:, p * r:(p + 1) * r, offsets[p]:offsets[p + 1]] = b.transpose(1, 2)
    x = torch.randn(T, hidden, generator=g)
    out0 = torch.randn(T, total, generator=g)
    seg_starts, seg_slots, scales = [0, 10, 11, 30, 33], [0, -1, 2, 1], [1.0, 0.5, 2.0]
    want = reference.sgmv(x, out0.clone(), a_fused, bt_fused, seg_starts, seg_slots, scales)
    x_dev = x.to(DEVICE)
    got = tk.sgmv(x_dev, out0.to(DEVICE, copy=True), *on_device(a_fused, bt_fused), seg_starts, seg_slots, scales)
    close(got.cpu(), want, torch.float32)
    per_token = torch.cat([torch.full((seg_starts[i + 1] - seg_starts[i],), s) for i, s in enumerate(seg_slots)])
    split = out0.to(DEVICE, copy=True)
    for p, (a, b) in enumerate(parts):
        tk.lora_shrink_expand(x_dev, split, *on_device(a, b, per_token, torch.tensor(scales)),
                              (offsets[p], offsets[p + 1]))
    close(split.cpu(), want, torch.float32)


def test_bad_slots_and_shapes_rejected():
    g = torch.Generator().manual_seed(9)
    a, b = on_device(*make_slots(2, [8, 8], 8, 40, 24, g, torch.float32))
    x, out = on_device(torch.randn(3, 40, generator=g), torch.zeros(3, 24))
    # slots on the host are range-checked (on a GPU the kernels skip bad ones: no host sync)
    with pytest.raises(IndexError):
        tk.lora_shrink_expand(x, out, a, b, torch.tensor([0, 2, -1]), torch.ones(2))
    with pytest.raises(IndexError):
        tk.sgmv(x, out, a, b.transpose(1, 2), [0, 1, 3], [0, 5], [1.0, 1.0])
    with pytest.raises(ValueError):
        tk.sgmv(x, out, a, b.transpose(1, 2), [0, 2, 1], [0, 1], [1.0, 1.0])
    with pytest.raises(ValueError):
        tk.lora_shrink_expand(x, out, a, b, torch.tensor([0, 1, -1]), torch.ones(2), out_slice=(0, 5))
    with pytest.raises(ValueError):
        tk.lora_shrink_expand(x.half(), out, a, b, torch.tensor([0, 1, -1]), torch.ones(2))
    assert torch.equal(out, torch.zeros(3, 24, device=DEVICE))


def test_dispatch_picks_triton_when_asked(monkeypatch, launches):
    """lockgate.kernels.lora (what the engine imports) takes the Triton path under
    LOCKGATE_KERNELS=triton (on DEVICE), the reference otherwise on the CPU, with matching
    results."""
    g = torch.Generator().manual_seed(10)
    a, b = make_slots(3, [8, 16, 4], 16, 72, 40, g, torch.float32)
    bt = b.transpose(1, 2).contiguous()
    x = torch.randn(17, 72, generator=g)
    out0 = torch.randn(17, 50, generator=g)
    slots = torch.randint(-1, 3, (17,), generator=g)
    scaling = torch.tensor([1.0, 0.5, 2.0])
    seg = ([0, 6, 9, 17], [1, -1, 2])
    cpu = torch.device("cpu")

    assert lora_pkg.implementation(cpu) == "reference"
    ref_tok = lora_pkg.lora_shrink_expand(x, out0.clone(), a, b, slots, scaling, (5, 45))
    ref_seg = lora_pkg.sgmv(x, out0.clone(), a, bt, *seg, scaling.tolist(), (5, 45))
    assert not launches

    monkeypatch.setenv("LOCKGATE_KERNELS", "triton")
    assert lora_pkg.implementation(DEVICE) == "triton"
    x_dev, a_dev, b_dev, bt_dev, slots_dev, scaling_dev = on_device(x, a, b, bt, slots, scaling)
    got_tok = lora_pkg.lora_shrink_expand(x_dev, out0.to(DEVICE, copy=True), a_dev, b_dev, slots_dev, scaling_dev,
                                          (5, 45))
    got_seg = lora_pkg.sgmv(x_dev, out0.to(DEVICE, copy=True), a_dev, bt_dev, *seg, scaling.tolist(), (5, 45))
    assert {name for name, _ in launches} == {"_bgmv_shrink_kernel", "_bgmv_expand_kernel",
                                             "_sgmv_shrink_kernel", "_sgmv_expand_kernel"}
    close(got_tok.cpu(), ref_tok, torch.float32)
    close(got_seg.cpu(), ref_seg, torch.float32)

    monkeypatch.setenv("TRITON_INTERPRET", "0")      # CPU tensors, no interpreter: fail loudly
    with pytest.raises(KernelUnavailable):
        lora_pkg.sgmv(x, out0.clone(), a, bt, *seg, scaling.tolist())


def test_engine_projection_under_triton(monkeypatch, launches):
    """A DenseLinear with LoRA slots attached, forward under LOCKGATE_KERNELS=triton, equals
    its forward on the reference."""
    from lockgate.engine.models.linear import DenseLinear, LoRABatch, LoRASlots

    g = torch.Generator().manual_seed(11)
    hidden, sizes, r = 40, [40, 24, 24], 8
    layer = DenseLinear(hidden, sizes, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(sum(sizes), hidden, generator=g) / hidden ** 0.5)
    a = torch.randn(2, 3 * r, hidden, generator=g) / hidden ** 0.5
    bt = torch.randn(2, 3 * r, sum(sizes), generator=g)
    batch = LoRABatch(active=True, seg_starts=[0, 7, 9, 17], seg_slots=[1, -1, 0], slots=frozenset({0, 1}),
                      scales=[2.0, 0.5])
    layer.lora = LoRASlots(lora_a=a, lora_bt=bt, scales=[2.0, 0.5], targeted={0, 1}, batch=batch)
    x = torch.randn(17, hidden, generator=g)
    with torch.no_grad():
        want = layer(x)             # on the CPU, LOCKGATE_KERNELS unset: the reference
        # the same layer and adapters on DEVICE (on the CPU: the same objects)
        layer.to(DEVICE)
        layer.lora = dataclasses.replace(layer.lora, lora_a=a.to(DEVICE), lora_bt=bt.to(DEVICE))
        monkeypatch.setenv("LOCKGATE_KERNELS", "triton")
        got = layer(x.to(DEVICE))
    assert launches
    close(got.cpu(), want, torch.float32)


def test_bench_cases_run_quick():
    from lockgate.kernels.lora.bench import cases

    found = cases(DEVICE, torch.float32, quick=True)
    assert any(c.baseline == "base layer without LoRA" for c in found)
    for c in found:
        assert c.kernel == "lora" and c.bound == "memory" and c.bytes_moved > 0 and c.flops > 0
        c.triton()
        c.reference()
