"""Paged attention in plain torch: the reference every device kernel is checked against.

The KV cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim].
A sequence's token at position p lives in block `block_tables[b, p // block_size]`, row
`p % block_size`. The flattened batch holds, for each sequence b, the queries of its newest
`query_start_loc[b+1] - query_start_loc[b]` tokens; the sequence's context after this step
is `seq_lens[b]` tokens, so query i of b sits at position seq_lens[b] - q_len + i and sees
keys [0, that position]. GQA: query head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache(
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset
) -> None:
    """Write each token's K and V into its slot, in place."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,         # [num_seqs] context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] cumulative query lengths
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context."""
    block_size = key_cache.shape[1]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    out = torch.empty_like(query)
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    gqa = query.shape[1] != num_kv_heads
    for b, ctx_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = -(-ctx_len // block_size)
        blocks = block_tables[b, :num_blocks]
        # gathers only this sequence's real context: no padding to the batch's longest
        k = key_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx_len].transpose(0, 1)
        v = value_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx_len].transpose(0, 1)
        q = query[start:end].transpose(0, 1)
        mask = None
        if 1 < q_len < ctx_len:
            pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device)
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= pos[:, None]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=(q_len > 1 and q_len == ctx_len),
            scale=scale, enable_gqa=gqa,
        )
        out[start:end] = o.transpose(0, 1)
    return out
