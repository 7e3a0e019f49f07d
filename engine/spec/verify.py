"""The verifier of speculative decoding: which of a row's k proposed tokens the target keeps,
and the token it adds after them.

A step gives the target's distribution at k + 1 positions of each row: after the context, and
after each of the k draft tokens. `accept_greedy` keeps the longest prefix of the draft that
equals the target's argmax; the target's own token follows (at the first mismatch, or the bonus
token after a fully accepted draft), so greedy output is exactly what greedy decoding without a
draft gives.

`rejection_sample` is the lossless rule for sampled rows (Leviathan et al. 2023, Chen et al.
2023): draft token x at position j is kept when u < min(1, p(x) / q(x)); at the first rejection
the emitted token is drawn from max(0, p - q) normalized, and after a fully accepted draft from
p at position num_draft. Every emitted token is then distributed as the target's p, whatever q
is. A deterministic proposer (n-gram: q one-hot on its token) passes `draft_probs=None`: the
test becomes u < p(x), the residual p with x removed.

Randomness comes in as arguments: `draw_randomness` builds it per row from the batch generator,
or for a seeded row from (seed, sample index, position) as the sampler seeds its own draws, so a
seeded request gives the same tokens on every run and whatever else is in the batch. Position
j's exponential noise is the very noise the sampler draws for a token at that position, so a
row with no draft samples its token exactly as it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lockgate.engine.sampler import seeded_generator

# Rows past a row's emitted tokens in `rejection_sample`'s output: never emitted.
NOT_EMITTED = -1


def accept_greedy(draft: torch.Tensor, target_argmax: torch.Tensor,
                  num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """draft [B,k] int64 proposed tokens (padded), target_argmax [B,k+1] the target's argmax at
    each of the k+1 positions, num_draft [B] how many of row b's k are real. Returns
    (accepted [B] = length of the longest prefix of draft equal to target_argmax, tokens [B,k+1]
    = target_argmax, of which row b emits tokens[b,:accepted[b]+1])."""
    _check_draft(draft, num_draft, target_argmax.shape[:2])
    real = _real(draft, num_draft)
    match = (draft == target_argmax[:, :-1]) & real
    return _prefix_len(match), target_argmax


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft: torch.Tensor,
                     num_draft: torch.Tensor, uniforms: torch.Tensor,
                     residual_noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """target_probs [B,k+1,V] (what the sampler would sample from), draft_probs [B,k,V] or None
    (a deterministic proposer: q one-hot on the draft token), draft [B,k], num_draft [B],
    uniforms [B,k] in [0,1), residual_noise [B,k+1,V] Exp(1) noise. Returns (accepted [B],
    tokens [B,k+1]): row b emits tokens[b,:accepted[b]+1] (the kept draft tokens, then the one
    drawn at the first rejection or the bonus token); later entries are NOT_EMITTED."""
    num_rows, k_plus_1, _ = target_probs.shape
    _check_draft(draft, num_draft, (num_rows, k_plus_1))
    if draft_probs is not None and draft_probs.shape != (num_rows, k_plus_1 - 1, target_probs.shape[2]):
        raise ValueError(f"draft_probs: shape {tuple(draft_probs.shape)}, want {(num_rows, k_plus_1 - 1)} + (V,)")
    if uniforms.shape != draft.shape or residual_noise.shape != target_probs.shape:
        raise ValueError("uniforms must be [B,k] and residual_noise [B,k+1,V]")
    real = _real(draft, num_draft)
    safe = torch.where(real, draft, 0)[..., None]          # padding may hold any id
    p = target_probs[:, :-1]
    p_x = p.gather(2, safe).squeeze(2)
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(2, safe).squeeze(2)
    accepted = _prefix_len((uniforms * q_x < p_x) & real)   # u < p/q without dividing by q
    # max(0, p - q); q one-hot on x leaves p with x removed
    residual = p.scatter(2, safe, 0.0) if draft_probs is None else (p - draft_probs).clamp_min(0.0)
    # no residual mass means p <= q everywhere there, so p == q and a rejection never happens;
    # p keeps the draw defined
    residual = torch.where(residual.sum(2, keepdim=True) > 0, residual, p)
    dist = torch.cat([torch.where(real[..., None], residual, p), target_probs[:, -1:]], dim=1)
    noise = residual_noise.clamp_min(torch.finfo(residual_noise.dtype).tiny)
    drawn = (dist / noise).argmax(dim=2)                    # Gumbel-max: one draw per position
    positions = torch.arange(k_plus_1, device=draft.device)[None, :]
    padded_draft = torch.cat([draft, draft.new_full((num_rows, 1), NOT_EMITTED)], dim=1)
    tokens = torch.where(positions < accepted[:, None], padded_draft,
                         torch.where(positions == accepted[:, None], drawn, NOT_EMITTED))
    return accepted, tokens


def draw_randomness(rows: Sequence[tuple[int | None, int, int]], num_spec: int, vocab_size: int,
                    generator: torch.Generator,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`uniforms` [B,k] and `residual_noise` [B,k+1,V] for `rejection_sample`, one row per
    (seed or None, sample index, position of the row's first new token). An unseeded row draws
    from `generator`; a seeded row's position j draws its noise, then its uniform, from the
    generator the sampler seeds for (seed, index, position + j)."""
    num_rows = len(rows)
    uniforms = torch.empty(num_rows, num_spec, device=device)
    noise = torch.empty(num_rows, num_spec + 1, vocab_size, device=device)
    unseeded = [i for i, (seed, _, _) in enumerate(rows) if seed is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), num_spec + 1, vocab_size,
                                      device=device).exponential_(generator=generator)
        uniforms[unseeded] = torch.rand(len(unseeded), num_spec, device=device, generator=generator)
    for i, (seed, index, position) in enumerate(rows):
        if seed is None:
            continue
        for j in range(num_spec + 1):
            g = seeded_generator(seed, index, position + j, device)
            noise[i, j].exponential_(generator=g)
            if j < num_spec:
                uniforms[i, j] = torch.rand((), device=device, generator=g)
    return uniforms, noise


def _check_draft(draft: torch.Tensor, num_draft: torch.Tensor, target_shape: Sequence[int]) -> None:
    num_rows, k_plus_1 = target_shape
    if draft.shape != (num_rows, k_plus_1 - 1) or num_draft.shape != (num_rows,):
        raise ValueError(f"draft must be [B,k] and num_draft [B] for a target of [B,k+1] = {tuple(target_shape)}; "
                         f"got draft {tuple(draft.shape)}, num_draft {tuple(num_draft.shape)}")


def _real(draft: torch.Tensor, num_draft: torch.Tensor) -> torch.Tensor:
    """[B,k] True where the draft token is a real proposal, not padding."""
    return torch.arange(draft.shape[1], device=draft.device)[None, :] < num_draft[:, None]


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """[B] how many leading entries of each row of `ok` [B,k] are True."""
    return ok.long().cumprod(dim=1).sum(dim=1)
