"""Multi-LoRA in plain torch: the reference every device kernel is checked against, and the
CPU path.

One batch mixes requests for several LoRA adapters (and for none). The adapters live in
*slots*: per target projection, stacked tensors

    lora_a: [num_slots, r_max, in]    (the "shrink" / down matrices, PEFT's lora_A.weight)
    lora_b: [num_slots, out, r_max]   (the "expand" / up matrices, PEFT's lora_B.weight)
    scaling: [num_slots]              (PEFT's lora_alpha / r, or alpha / sqrt(r) with rslora)

An adapter of rank r < r_max is stored zero-padded: lora_a[s, r:, :] = 0 and
lora_b[s, :, r:] = 0, so the padded rank rows/columns contribute exactly nothing (0 * anything
finite is 0) and one slot tensor holds adapters of mixed ranks. A slot that is free should be
all zero too, although no token should point at it.

`lora_shrink_expand` computes, for each token t with slot s = slot_per_token[t] >= 0,

    out[t, lo:hi] += scaling[s] * (x[t] @ lora_a[s].T) @ lora_b[s].T

in place; tokens with slot -1 (no adapter) are left untouched. `out_slice = (lo, hi)` lets a
LoRA on one projection land in its slice of a fused output: the engine fuses q/k/v into
`qkv_proj` ([q_size | kv_size | kv_size]) and gate/up into `gate_up_proj`, so a LoRA on
v_proj is applied with out_slice=(q_size + kv_size, q_size + 2 * kv_size) and lora_b's
`out` is hi - lo.

This is SGMV ("segmented gather matrix-vector", Punica; S-LoRA's multi-adapter batching):
the tokens are sorted by slot into contiguous segments, and each segment does one gather of
its rows, one shrink matmul [n, in] @ [in, r_max], one expand matmul [n, r_max] @ [r_max, out]
and one scatter-add back, so the cost is a few ops per distinct adapter in the batch, not per
token. (The per-token gather-all variant, BGMV, is what a decode-only device kernel does; on
CPU the grouped matmuls are faster and need no [T, r_max, in] gathered weight copy.)
"""

from __future__ import annotations

import torch


def check_shrink_expand_args(
    x: torch.Tensor,
    out: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_per_token: torch.Tensor,
    scaling: torch.Tensor,
    out_slice: tuple[int, int] | None,
) -> tuple[int, int]:
    """The shapes `lora_shrink_expand` takes (here and in the Triton wrapper): ValueError on
    any mismatch; returns the target columns (lo, hi), `out_slice` or the whole row."""
    num_tokens = x.shape[0]
    if x.dim() != 2 or out.dim() != 2 or out.shape[0] != num_tokens:
        raise ValueError(f"x must be [T, in] and out [T, out_total], got {tuple(x.shape)} and {tuple(out.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError("lora_a must be [num_slots, r_max, in] and lora_b [num_slots, out, r_max]")
    num_slots, r_max, in_features = lora_a.shape
    lo, hi = out_slice if out_slice is not None else (0, out.shape[1])
    if not 0 <= lo <= hi <= out.shape[1]:
        raise ValueError(f"out_slice {(lo, hi)} is outside out's {out.shape[1]} columns")
    if in_features != x.shape[1]:
        raise ValueError(f"lora_a takes {in_features} inputs, x has {x.shape[1]}")
    if tuple(lora_b.shape) != (num_slots, hi - lo, r_max):
        raise ValueError(f"lora_b must be {(num_slots, hi - lo, r_max)}, got {tuple(lora_b.shape)}")
    if slot_per_token.shape != (num_tokens,):
        raise ValueError(f"slot_per_token must be [{num_tokens}], got {tuple(slot_per_token.shape)}")
    if tuple(scaling.shape) != (num_slots,):
        raise ValueError(f"scaling must be [{num_slots}], got {tuple(scaling.shape)}")
    return lo, hi


def lora_shrink_expand(
    x: torch.Tensor,               # [T, in]
    out: torch.Tensor,             # [T, out_total], added to in place
    lora_a: torch.Tensor,          # [num_slots, r_max, in]
    lora_b: torch.Tensor,          # [num_slots, hi - lo, r_max]
    slot_per_token: torch.Tensor,  # [T] int64, -1 = no adapter
    scaling: torch.Tensor,         # [num_slots] float
    out_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Add each token's LoRA delta, scaling[s] * x[t] A_s^T B_s^T, into out[t, lo:hi] in place
    (see the module docstring); tokens with slot -1 are skipped. Returns `out`.

    The delta is computed in x's dtype and added in out's dtype. `out_slice` defaults to the
    whole row, (0, out.shape[1])."""
    lo, hi = check_shrink_expand_args(x, out, lora_a, lora_b, slot_per_token, scaling, out_slice)
    num_tokens, num_slots = x.shape[0], lora_a.shape[0]
    if num_tokens == 0 or hi == lo:
        return out

    # segments: tokens sorted by slot (stable, so each segment keeps the batch order)
    slots_sorted, order = torch.sort(slot_per_token, stable=True)
    uniq, counts = torch.unique_consecutive(slots_sorted, return_counts=True)
    uniq_l, counts_l = uniq.tolist(), counts.tolist()   # the one host sync
    if uniq_l[-1] >= num_slots or uniq_l[0] < -1:
        raise IndexError(f"slot_per_token must be in [-1, {num_slots}), got {uniq_l[0]}..{uniq_l[-1]}")
    target = out[:, lo:hi]
    scales = scaling.tolist()
    start = 0
    for slot, n in zip(uniq_l, counts_l, strict=True):
        if slot >= 0:
            rows = order[start:start + n]
            xs = x.index_select(0, rows)                               # gather   [n, in]
            shrunk = xs @ lora_a[slot].transpose(0, 1)                 # shrink   [n, r_max]
            delta = shrunk @ lora_b[slot].transpose(0, 1)              # expand   [n, hi - lo]
            target.index_add_(0, rows, delta.to(out.dtype), alpha=scales[slot])  # scatter-add
        start += n
    return out



def sgmv(
    x: torch.Tensor,               # [T, in]
    out: torch.Tensor,             # [T, out_total], added to in place
    lora_a: torch.Tensor,          # [num_slots, r_max, in]
    lora_bt: torch.Tensor,         # [num_slots, r_max, hi - lo]: B transposed, ready to right-multiply
    seg_starts: list[int],         # [S + 1] row offsets of contiguous segments
    seg_slots: list[int],          # [S] slot of each segment, -1 = no adapter
    scales: list[float],           # [num_slots]
    out_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`lora_shrink_expand` for a batch already grouped by adapter: segment i is rows
    seg_starts[i]:seg_starts[i+1], all of slot seg_slots[i] (Punica's seg_indptr form). No
    sort, gather or scatter: each segment is one shrink and one expand on a row slice. The
    engine orders each step's sequences by adapter so that every adapter is one segment.
    The expand matrices come transposed (lora_bt[s] = lora_b[s].T), as the engine keeps them."""
    lo, hi = out_slice if out_slice is not None else (0, out.shape[1])
    if len(seg_starts) != len(seg_slots) + 1:
        raise ValueError("seg_starts must have one more entry than seg_slots")
    target = out[:, lo:hi]
    for i, slot in enumerate(seg_slots):
        if slot < 0:
            continue
        a0, a1 = seg_starts[i], seg_starts[i + 1]
        delta = (x[a0:a1] @ lora_a[slot].transpose(0, 1)) @ lora_bt[slot]
        target[a0:a1].add_(delta.to(out.dtype), alpha=scales[slot])
    return out


def lora_masked(
    x: torch.Tensor,               # [T, in]
    out: torch.Tensor,             # [T, out_total], added to in place
    lora_a: torch.Tensor,          # [num_slots, r_max, in]
    lora_bt: torch.Tensor,         # [num_slots, r_max, hi - lo]
    mask: torch.Tensor,            # [T, num_slots * r_max]: scaling[s] on token t's slot's columns, else 0
    out_slice: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The same delta as `lora_shrink_expand`, computed against every slot at once: shrink
    x by all slots' A stacked ([T, slots * r_max]), zero each token's columns of other slots
    (and scale its own) with `mask`, expand by all slots' B stacked. Three ops whatever the
    number of adapters, at num_slots times the arithmetic: the better choice for few tokens
    (decode steps), where per-segment calls cost more in dispatch than in arithmetic.
    `slot_mask` builds the mask."""
    lo, hi = out_slice if out_slice is not None else (0, out.shape[1])
    num_slots, r_max, in_features = lora_a.shape
    shrunk = x @ lora_a.reshape(num_slots * r_max, in_features).transpose(0, 1)
    shrunk.mul_(mask)
    out[:, lo:hi].add_((shrunk @ lora_bt.reshape(num_slots * r_max, hi - lo)).to(out.dtype))
    return out


def slot_mask(
    seg_starts: list[int], seg_slots: list[int], scales: list[float], num_slots: int, r_max: int,
    dtype: torch.dtype, device: torch.device | str = "cpu",
) -> torch.Tensor:
    """[T, num_slots * r_max] mask for `lora_masked` from contiguous segments."""
    mask = torch.zeros(seg_starts[-1], num_slots, r_max, dtype=dtype, device=device)
    for i, slot in enumerate(seg_slots):
        if slot >= 0:
            mask[seg_starts[i]:seg_starts[i + 1], slot] = scales[slot]
    return mask.view(seg_starts[-1], num_slots * r_max)
