"""Paged attention in plain torch: the reference every device kernel is checked against,
and the CPU path.

The KV cache of one layer is two tensors [num_kv_heads, num_blocks, block_size, head_dim]
(head-major, so a gathered context is contiguous per head and feeds matmul without a copy).
A sequence's token at position p lives in block `block_tables[b, p // block_size]`, row
`p % block_size`. The flattened batch holds, for each sequence b, the queries of its newest
`query_start_loc[b+1] - query_start_loc[b]` tokens; the sequence's context after this step
is `seq_lens[b]` tokens, so query i of b sits at position seq_lens[b] - q_len + i and sees
keys [0, that position]. GQA: query head h reads KV head h // (num_heads // num_kv_heads).

On CPU, attention is bound by memory traffic: copying a context out of its blocks costs
more than reading it once. A sequence whose blocks are consecutive ids (the block pool
places them so where it can) is a view of the cache, [num_kv_heads, len, head_dim] with no
copy, and goes through SDPA on its own. The others are gathered: decodes (one query)
sorted by length and cut into groups whose padding stays small, one gather and two matmuls
per group; prefill chunks one sequence at a time through SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_DECODE_GROUP = 32
MAX_PADDING_RATIO = 1.25   # padded tokens / real tokens allowed in a decode group


def write_kv_cache(
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,    # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block_id * block_size + offset
) -> None:
    """Write each token's K and V into its slot, in place."""
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
    key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def paged_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,        # [num_kv_heads, num_blocks, block_size, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,     # [num_seqs, max_blocks] int64
    seq_lens: torch.Tensor,         # [num_seqs] context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] cumulative query lengths
    scale: float,
    first_slots: list[int] | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.
    `first_slots`: `contiguous_first_slots` of these tables, when the caller computed it once
    for every layer of a step; worked out here when None."""
    out = torch.empty_like(query)
    _attend(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            first_slots, out, decodes_too=True)
    return out


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_slots: list[int] | None,
    out: torch.Tensor,
) -> None:
    """As `paged_attention`, into `out`, for the sequences with more than one new query
    (prefill chunks) only; decode rows of `out` are left as they are."""
    _attend(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            first_slots, out, decodes_too=False)


def _attend(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
            first_slots, out, decodes_too: bool) -> None:
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    if first_slots is None:
        first_slots = contiguous_first_slots(block_tables, seq_lens, key_cache.shape[2])
    num_kv_heads, head_dim = key_cache.shape[0], key_cache.shape[3]
    key_slots = key_cache.view(1, num_kv_heads, -1, head_dim)      # [1, kv_heads, slots, D]
    value_slots = value_cache.view(1, num_kv_heads, -1, head_dim)
    # one query attends to its whole context, so the query heads that share a KV head can
    # be that head's query rows: SDPA without GQA's expansion of K and V to every query head
    per_kv = query.shape[1] // num_kv_heads
    query_rows = query.view(-1, num_kv_heads, per_kv, head_dim)
    out_rows = out.view(-1, num_kv_heads, per_kv, head_dim)
    decodes = []
    for b, ctx_len in enumerate(lens):
        start, end = starts[b], starts[b + 1]
        first = first_slots[b]
        if end - start == 1 and not decodes_too:
            continue
        if first >= 0 and end - start == 1:
            out_rows[start] = F.scaled_dot_product_attention(
                query_rows[start:end], key_slots[:, :, first:first + ctx_len],
                value_slots[:, :, first:first + ctx_len], scale=scale)[0]
        elif first >= 0 and end > start:
            _sdpa(query[start:end], key_slots[0, :, first:first + ctx_len],
                  value_slots[0, :, first:first + ctx_len], ctx_len, scale, out[start:end])
        elif end - start == 1:
            decodes.append(b)
        elif end > start:
            prefill_one(query, key_cache, value_cache, block_tables[b], ctx_len,
                         start, end, scale, out)
    if decodes:
        for group in _decode_groups(decodes, lens):
            _decode_group(query, key_cache, value_cache, block_tables, lens, starts, group, scale, out)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The blocks' rows, in order, per head: [num_kv_heads, len(blocks) * block_size, head_dim].
    One index_select over the cache seen as [heads * blocks, block_size * head_dim] (with a
    per-head offset) copies faster than an index_select along dim 1."""
    num_kv_heads, num_blocks = cache.shape[0], cache.shape[1]
    offsets = torch.arange(0, num_kv_heads * num_blocks, num_blocks, device=blocks.device)
    rows = (offsets[:, None] + blocks[None, :]).reshape(-1)
    flat = cache.view(num_kv_heads * num_blocks, -1)
    return flat.index_select(0, rows).view(num_kv_heads, -1, cache.shape[3])


def contiguous_first_slots(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list[int]:
    """Per sequence: the cache slot of its first token if its blocks are consecutive ids
    (its context is then one slice of the cache), else -1. A few ops over the whole table."""
    if block_tables.shape[1] == 0:
        return [-1] * block_tables.shape[0]
    num_blocks = (seq_lens + block_size - 1) // block_size
    first = block_tables[:, 0]
    col = torch.arange(block_tables.shape[1], device=block_tables.device)
    consecutive = (block_tables == first[:, None] + col) | (col >= num_blocks[:, None])
    return torch.where(consecutive.all(1), first * block_size, -1).tolist()


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_len: int, scale: float,
          out: torch.Tensor) -> None:
    """One sequence: q [q_len, heads, D] over its whole context k, v [kv_heads, ctx_len, D]."""
    q_len = q.shape[0]
    q = q.transpose(0, 1)
    mask = None
    if 1 < q_len < ctx_len:   # a later chunk: query i sits at ctx_len - q_len + i
        pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= pos[:, None]
    # 4-D (batch of one): CPU SDPA takes its flash kernel only with a batch dimension; one
    # query sees the whole context (no mask); a whole prompt is plain causal
    o = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=mask, is_causal=q_len > 1 and mask is None,
        scale=scale, enable_gqa=q.shape[0] != k.shape[0],
    )
    out.copy_(o[0].transpose(0, 1))


def prefill_one(query, key_cache, value_cache, table, ctx_len, start, end, scale, out) -> None:
    """One prefill chunk (query rows start..end) over its context gathered through its block table."""
    block_size = key_cache.shape[2]
    blocks = table[: -(-ctx_len // block_size)]
    # gathers only this sequence's real context: no padding to the batch's longest
    k = _gather(key_cache, blocks)[:, :ctx_len]
    v = _gather(value_cache, blocks)[:, :ctx_len]
    _sdpa(query[start:end], k, v, ctx_len, scale, out[start:end])


def _decode_groups(decodes: list[int], lens: list[int]) -> list[list[int]]:
    """Decodes sorted by context length, cut where padding would exceed the allowed ratio."""
    order = sorted(decodes, key=lambda b: lens[b])
    groups: list[list[int]] = []
    group: list[int] = []
    real = 0
    for b in order:
        # sorted ascending, so b is the longest: padded size = len(group + 1) * lens[b]
        if group and (len(group) >= MAX_DECODE_GROUP
                      or (len(group) + 1) * lens[b] > MAX_PADDING_RATIO * (real + lens[b])):
            groups.append(group)
            group, real = [], 0
        group.append(b)
        real += lens[b]
    if group:
        groups.append(group)
    return groups


def _decode_group(query, key_cache, value_cache, block_tables, lens, starts, group, scale, out) -> None:
    dev = query.device
    num_kv_heads, block_size, head_dim = key_cache.shape[0], key_cache.shape[2], key_cache.shape[3]
    num_heads = query.shape[1]
    g = len(group)
    max_len = max(lens[b] for b in group)
    num_blocks = -(-max_len // block_size)
    padded_len = num_blocks * block_size
    rows = torch.tensor(group, device=dev)
    blocks = block_tables.index_select(0, rows)[:, :num_blocks].reshape(-1)
    k = _gather(key_cache, blocks).view(num_kv_heads, g, padded_len, head_dim)
    v = _gather(value_cache, blocks).view(num_kv_heads, g, padded_len, head_dim)
    token_rows = torch.tensor([starts[b] for b in group], device=dev)
    q = query.index_select(0, token_rows).view(g, num_kv_heads, num_heads // num_kv_heads, head_dim)
    q = q.transpose(0, 1)                                            # [kv_heads, g, group, D]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale            # [kv_heads, g, group, L]
    seq_lens = torch.tensor([lens[b] for b in group], device=dev)
    pad = torch.arange(padded_len, device=dev)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(pad[None, :, None, :], float("-inf"))
    # padded slots were never written: zero those rows (only them: a masked_fill over all
    # of V would rewrite every row) so that 0 * (whatever was there) stays 0
    v.view(num_kv_heads, g * padded_len, head_dim).index_fill_(1, pad.reshape(-1).nonzero().squeeze(1), 0.0)
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v)                                       # [kv_heads, g, group, D]
    out.index_copy_(0, token_rows, o.transpose(0, 1).reshape(g, num_heads, head_dim))
