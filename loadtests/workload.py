"""Fixed-seed offline workloads shared by the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class OfflineRequest:
    prompt_token_ids: list[int]
    output_len: int          # forced with ignore_eos: every side produces exactly this many


def offline_workload(
    *,
    num_requests: int,
    vocab_size: int,
    special_ids: set[int],
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (16, 256),
    seed: int = 0,
) -> list[OfflineRequest]:
    """Prompts of uniformly drawn token ids (no special tokens) and lengths, in arrival order."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab_size) if t not in special_ids])
    out = []
    for _ in range(num_requests):
        p_len = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        o_len = int(torch.randint(output_len[0], output_len[1] + 1, (1,), generator=g))
        ids = allowed[torch.randint(0, len(allowed), (p_len,), generator=g)].tolist()
        out.append(OfflineRequest(ids, o_len))
    return out
