"""lockgate.kernels.lora.lora_shrink_expand (SGMV semantics) against a naive per-token loop."""

from __future__ import annotations

import pytest
import torch

from lockgate.kernels.lora import lora_shrink_expand


def naive(x, out, lora_a, lora_b, slots, scaling, out_slice):
    out = out.clone()
    lo, hi = out_slice
    for t in range(x.shape[0]):
        s = int(slots[t])
        if s < 0:
            continue
        out[t, lo:hi] += float(scaling[s]) * ((x[t] @ lora_a[s].T) @ lora_b[s].T)
    return out


def make_slots(num_slots, ranks, r_max, in_f, out_f, g):
    """Slot tensors with adapter s of rank ranks[s], zero-padded up to r_max."""
    a = torch.zeros(num_slots, r_max, in_f)
    b = torch.zeros(num_slots, out_f, r_max)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, in_f, generator=g) / in_f ** 0.5
        b[s, :, :r] = torch.randn(out_f, r, generator=g)
    return a, b


def test_matches_naive_loop_mixed_slots_and_ranks():
    g = torch.Generator().manual_seed(0)
    T, in_f, out_f, r_max = 57, 48, 40, 16
    ranks = [16, 4, 8, 1, 0]          # slot 4 is empty (all zero)
    a, b = make_slots(len(ranks), ranks, r_max, in_f, out_f, g)
    x = torch.randn(T, in_f, generator=g)
    out0 = torch.randn(T, out_f, generator=g)
    slots = torch.randint(-1, len(ranks), (T,), generator=g)
    slots[:3] = -1
    scaling = torch.tensor([2.0, 0.5, 1.0, 4.0, 1.0])
    want = naive(x, out0, a, b, slots, scaling, (0, out_f))
    out = out0.clone()
    ret = lora_shrink_expand(x, out, a, b, slots, scaling)
    assert ret is out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # untouched where slot is -1 or the empty slot
    untouched = (slots == -1) | (slots == 4)
    assert torch.equal(out[untouched], out0[untouched])
    assert not torch.allclose(out[~untouched], out0[~untouched])


def test_zero_padding_equals_unpadded_rank():
    g = torch.Generator().manual_seed(1)
    T, in_f, out_f, r, r_max = 9, 32, 24, 3, 8
    a_small = torch.randn(1, r, in_f, generator=g)
    b_small = torch.randn(1, out_f, r, generator=g)
    a_pad = torch.zeros(1, r_max, in_f)
    b_pad = torch.zeros(1, out_f, r_max)
    a_pad[:, :r], b_pad[:, :, :r] = a_small, b_small
    x = torch.randn(T, in_f, generator=g)
    slots = torch.zeros(T, dtype=torch.int64)
    scaling = torch.tensor([0.75])
    o1 = lora_shrink_expand(x, torch.zeros(T, out_f), a_small, b_small, slots, scaling)
    o2 = lora_shrink_expand(x, torch.zeros(T, out_f), a_pad, b_pad, slots, scaling)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(o1, 0.75 * x @ a_small[0].T @ b_small[0].T, rtol=1e-5, atol=1e-5)


def test_out_slice_on_fused_qkv():
    """q/k/v fused as [q | k | v]: a LoRA on v lands in the v slice and nowhere else."""
    g = torch.Generator().manual_seed(2)
    T, hidden, q_size, kv_size, r_max = 20, 64, 64, 32, 8
    total = q_size + 2 * kv_size
    x = torch.randn(T, hidden, generator=g)
    out0 = torch.randn(T, total, generator=g)
    slots = torch.tensor([0, -1, 1, 2, 0, 1, -1, 2, 2, 0, 1, 1, 0, -1, 2, 0, 0, 1, 2, -1])
    scaling = torch.tensor([1.0, 2.0, 0.25])
    aq, bq = make_slots(3, [8, 2, 4], r_max, hidden, q_size, g)
    av, bv = make_slots(3, [4, 8, 1], r_max, hidden, kv_size, g)
    v_slice = (q_size + kv_size, total)
    want = naive(x, out0, aq, bq, slots, scaling, (0, q_size))
    want = naive(x, want, av, bv, slots, scaling, v_slice)
    out = out0.clone()
    lora_shrink_expand(x, out, aq, bq, slots, scaling, out_slice=(0, q_size))
    lora_shrink_expand(x, out, av, bv, slots, scaling, out_slice=v_slice)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, q_size:q_size + kv_size], out0[:, q_size:q_size + kv_size])  # k untouched


def test_empty_batch():
    a, b = torch.randn(2, 4, 8), torch.randn(2, 6, 4)
    out = torch.empty(0, 6)
    lora_shrink_expand(torch.empty(0, 8), out, a, b, torch.empty(0, dtype=torch.int64), torch.ones(2))
    assert out.shape == (0, 6)


def test_all_tokens_without_adapter():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 4, generator=g)
    out0 = torch.randn(5, 6, generator=g)
    out = out0.clone()
    lora_shrink_expand(torch.randn(5, 8, generator=g), out, a, b, torch.full((5,), -1), torch.ones(2))
    assert torch.equal(out, out0)


def test_bad_slot_and_shapes_rejected():
    a, b = torch.randn(2, 4, 8), torch.randn(2, 6, 4)
    x, out = torch.randn(3, 8), torch.zeros(3, 6)
    with pytest.raises(IndexError):
        lora_shrink_expand(x, out, a, b, torch.tensor([0, 2, -1]), torch.ones(2))
    with pytest.raises(ValueError):
        lora_shrink_expand(x, out, a, b, torch.tensor([0, 1, -1]), torch.ones(2), out_slice=(0, 5))


def test_sgmv_on_contiguous_segments_matches_the_general_form():
    """sgmv (rows grouped by slot, Punica's seg_indptr) equals lora_shrink_expand given the
    same per-token slots, base segments (-1) included, into a slice of a fused output."""
    from lockgate.kernels.lora import lora_masked, sgmv, slot_mask

    g = torch.Generator().manual_seed(3)
    in_f, out_f, r_max = 32, 24, 8
    a, b = make_slots(3, [8, 2, 5], r_max, in_f, out_f, g)
    seg_slots = [-1, 2, 0, -1, 1]
    seg_starts = [0, 4, 11, 12, 20, 27]
    per_token = torch.cat([torch.full((seg_starts[i + 1] - seg_starts[i],), s) for i, s in enumerate(seg_slots)])
    x = torch.randn(27, in_f, generator=g)
    base = torch.randn(27, 40, generator=g)
    scaling = torch.tensor([2.0, 0.25, 1.5])
    want = lora_shrink_expand(x, base.clone(), a, b, per_token, scaling, (10, 34))
    bt = b.transpose(1, 2).contiguous()   # the engine keeps B transposed
    got = sgmv(x, base.clone(), a, bt, seg_starts, seg_slots, scaling.tolist(), (10, 34))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:4], base[:4]) and not torch.equal(got[4:11], base[4:11])
    # the masked form (every slot at once, other slots' columns zeroed) agrees too
    mask = slot_mask(seg_starts, seg_slots, scaling.tolist(), 3, r_max, torch.float32)
    masked = lora_masked(x, base.clone(), a, bt, mask, (10, 34))
    torch.testing.assert_close(masked, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(masked[:4], base[:4])
