"""The paged-attention reference against plain dense attention over each sequence's own
contiguous K/V, with odd sizes, scattered block tables and garbage in unwritten slots.
Sequences whose blocks are consecutive ids take the no-copy path (views of the cache), the
others the gather path: both layouts, and a mix, are checked."""

from __future__ import annotations

import pytest
import torch

from lockgate.kernels.paged_attention import paged_attention, write_kv_cache


def dense(q, k, v, scale):
    """q [q_len, H, D] at the last q_len positions of k/v [L, Hkv, D]; causal."""
    q_len, L = q.shape[0], k.shape[0]
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).transpose(0, 1)
    v = v.repeat_interleave(groups, dim=1).transpose(0, 1)
    s = (q.transpose(0, 1) @ k.transpose(-1, -2)) * scale
    pos = torch.arange(L - q_len, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > pos, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("layout", ["scattered", "consecutive", "mixed"])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (8, 1)])
def test_matches_dense_attention(block_size, heads, layout):
    torch.manual_seed(0)
    num_heads, num_kv_heads = heads
    head_dim, num_blocks = 24, 300
    # (context length after the step, new tokens): decodes of many lengths, prefill chunks
    seqs = [(1, 1), (37, 1), (38, 1), (100, 1), (5, 5), (64, 17), (129, 1), (3, 2), (250, 1), (17, 17)]
    kc = torch.full((num_kv_heads, num_blocks, block_size, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))     # unwritten slots hold garbage
    # scattered tables draw from the lower half, consecutive runs go downwards from the top
    perm = torch.randperm(num_blocks if layout == "scattered" else num_blocks // 2).tolist()
    next_run = num_blocks
    tables, ks, vs, qs = [], [], [], []
    for i, (ctx, _) in enumerate(seqs):
        n = -(-ctx // block_size)
        if layout == "consecutive" or (layout == "mixed" and i % 2):
            next_run -= n + 1                  # a gap of one unwritten (NaN) block after each
            tables.append(list(range(next_run, next_run + n)))
        else:
            tables.append([perm.pop() for _ in range(n)])
        ks.append(torch.randn(ctx, num_kv_heads, head_dim))
        vs.append(torch.randn(ctx, num_kv_heads, head_dim))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    for t, k, v in zip(tables, ks, vs, strict=True):
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(len(k))])
        write_kv_cache(k, v, kc, vc, slots)
    starts = [0]
    for _, q_len in seqs:
        qs.append(torch.randn(q_len, num_heads, head_dim))
        starts.append(starts[-1] + q_len)
    out = paged_attention(torch.cat(qs), kc, vc, bt, torch.tensor([c for c, _ in seqs]),
                          torch.tensor(starts), head_dim**-0.5)
    assert torch.isfinite(out).all()
    for i, (q, k, v) in enumerate(zip(qs, ks, vs, strict=True)):
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], dense(q, k, v, head_dim**-0.5),
                                   atol=1e-5, rtol=1e-5)
