"""Turns the last-position logits of a step into tokens, one row per sampled sequence.

Every row applies its penalties and logit bias first. Greedy rows then take the argmax;
other rows apply temperature, top-k, top-p and min-p, then draw with the exponential-race
trick (argmax of p / Exp(1) noise). A row with a grammar (structured outputs) keeps only the
tokens its grammar allows, after penalties and before choosing; its logprobs are the
model's own, before the bias and the mask. A seeded row draws its noise from a generator
seeded by (seed, sample index, position), so its tokens do not depend on what else is in
the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lockgate.engine.grammar import grammar_bitmask, mask_logits
from lockgate.engine.sampling_params import SamplingParams
from lockgate.kernels.pointwise import argmax_rows

if TYPE_CHECKING:
    from llguidance import LLMatcher


@dataclass(slots=True)
class SampleRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sample_index: int
    position: int            # position of the token being sampled
    grammar: LLMatcher | None = None   # the sequence's grammar: only the tokens it allows


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # per row: (logprob of the chosen token, its rank, top-k [(token, logprob)]) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]
    # rows whose drafts were verified already (rejection sampling against a draft model's q):
    # the row's first sampler row -> how many of its drafts it keeps
    accepted_at: dict[int, int] = field(default_factory=dict)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.device = device

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """`bitmask`: the grammar rows' allowed tokens, in row order, when computed already
        (the runner computes them while the forward runs); else they are computed here."""
        logits = logits.float()
        num_rows = len(rows)
        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        cloned = any(r.params.needs_penalties or r.params.logit_bias for r in rows)
        if cloned:
            logits = logits.clone()
            for i, r in enumerate(rows):
                if r.params.needs_penalties:
                    _apply_penalties(logits[i], r)
                if r.params.logit_bias:
                    _apply_bias(logits[i], r.params.logit_bias)
        guided = [i for i, r in enumerate(rows) if r.grammar is not None]
        if guided:
            logits = logits if cloned else logits.clone()
            if bitmask is None:
                matchers = [g for g in (rows[i].grammar for i in guided) if g is not None]
                bitmask = grammar_bitmask(matchers, logits.shape[-1])
            mask_logits(logits, guided, bitmask)
        chosen = torch.empty(num_rows, dtype=torch.long, device=logits.device)
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device) if len(greedy) < num_rows else None
            chosen_g = argmax_rows(logits if idx is None else logits[idx])
            if idx is None:
                chosen = chosen_g
            else:
                chosen[idx] = chosen_g
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            probs = self.filtered_probs(logits[idx], [rows[i] for i in sampled])
            noise = self._noise(probs, [rows[i] for i in sampled])
            chosen[idx] = argmax_rows(probs / noise)
        token_ids = chosen.tolist()
        out_logprobs: list = [None] * num_rows
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.params.logprobs is None:
                    continue
                out_logprobs[i] = logprob_entry(raw_logprobs[i], token_ids[i], r.params.logprobs)
        return SamplerOutput(token_ids, out_logprobs)

    def target_probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """What sampled rows (no grammar) draw from: penalties and bias applied, then
        temperature, top-k, top-p and min-p (a draft model's verifier needs p itself)."""
        logits = logits.float().clone()
        for i, r in enumerate(rows):
            if r.params.needs_penalties:
                _apply_penalties(logits[i], r)
            if r.params.logit_bias:
                _apply_bias(logits[i], r.params.logit_bias)
        return self.filtered_probs(logits, rows)

    def filtered_probs(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        dev = logits.device
        temps = torch.tensor([r.params.temperature for r in rows], device=dev)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        top_ks = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
        if any(k < vocab for k in top_ks):
            k_max = max(k for k in top_ks if k < vocab)
            kth = logits.topk(k_max, dim=-1).values   # [B, k_max], descending
            ks = torch.tensor([min(k, k_max) - 1 for k in top_ks], device=dev)
            threshold = kth.gather(1, ks[:, None])
            keep_all = torch.tensor([k >= vocab for k in top_ks], device=dev)[:, None]
            logits = logits.masked_fill(~keep_all & (logits < threshold), float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        top_ps = [r.params.top_p for r in rows]
        if any(p < 1.0 for p in top_ps):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            before = sorted_p.cumsum(dim=-1) - sorted_p       # mass strictly above each token
            drop_sorted = before >= torch.tensor(top_ps, device=dev)[:, None]
            drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_ps = [r.params.min_p for r in rows]
        if any(m > 0.0 for m in min_ps):
            cutoff = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=dev)[:, None]
            probs = probs.masked_fill(probs < cutoff, 0.0)
        return probs

    def _noise(self, probs: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_(generator=self.generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                g = seeded_generator(r.params.seed, r.sample_index, r.position, probs.device)
                noise[i].exponential_(generator=g)
        return noise


def logprob_entry(row: torch.Tensor, token: int, num_top: int) -> tuple[float, int, list[tuple[int, float]]]:
    """(logprob of `token`, its rank, the `num_top` best [(token, logprob)]) from a row of logprobs."""
    lp = row[token].item()
    rank = int((row > lp).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if num_top > 0:
        vals, ids = row.topk(num_top)
        top = list(zip(ids.tolist(), vals.tolist(), strict=True))
    return lp, rank, top


def seeded_generator(seed: int, index: int, position: int, device: torch.device) -> torch.Generator:
    """The generator a seeded row draws from for the token at `position` of sample `index`:
    the same (seed, index, position) gives the same draws whatever else runs in the batch."""
    g = torch.Generator(device=device)
    g.manual_seed(_mix(seed, index, position))
    return g


def _mix(seed: int, index: int, position: int) -> int:
    """A 63-bit seed from (seed, sample index, position), splitmix64-style."""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB)
    x &= (1 << 64) - 1
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 27
    return x & ((1 << 63) - 1)


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    """In place on one row. repetition_penalty over prompt and output (HF's rule: positive
    logits divided, negative multiplied); presence and frequency over the output (OpenAI's)."""
    p = row.params
    dev = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), device=dev, dtype=torch.long)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        out = torch.tensor(row.output_token_ids, device=dev, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[0]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _apply_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    """In place on one row: each token's bias added to its logit."""
    ids = torch.tensor(list(bias), device=logits.device, dtype=torch.long)
    logits[ids] += torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
