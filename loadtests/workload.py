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


def prompts_for(model_dir: str, lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths, token ids drawn uniformly from the model's vocabulary
    without its special tokens."""
    from lockgate.engine.config import ModelConfig
    from lockgate.engine.tokenizer import Tokenizer

    vocab = ModelConfig.from_dir(model_dir).vocab_size
    special = Tokenizer(model_dir).special_token_ids | set(ModelConfig.from_dir(model_dir).eos_token_ids)
    allowed = torch.tensor(sorted(set(range(vocab)) - special))
    g = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist() for n in lengths]


def demo_dir(family: str, size: str, seed: int) -> str:
    """A demo model directory under `cache_dir()`, written on first use."""
    from lockgate.loadtests.cache import demo_model_dir

    return str(demo_model_dir(family, size, seed))
