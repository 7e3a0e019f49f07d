"""Speculative decoding in the step: draft tokens for decodes, and what the target keeps.

The scheduler asks `try_drafts` for each running decode: up to k tokens from the proposer
(engine/spec/ngram.py), fewer where the step's token budget, `max_tokens` or the context its
class may use leave less room, none for a request that opted out (`speculative=False`), one
with a grammar (its matcher would have to follow the draft: such rows decode a token a step
for now), or a class the switch (engine/spec/switch.py) has turned off. A row with a LoRA
adapter drafts too: its chunk is one more segment of its adapter's tokens. The row then computes its last token and
the drafts as one short chunk over the paged KV cache; the runner samples a token at each of
its 1 + d positions, the row at position j seeing the drafts before it as its history (so
penalties, logit bias and seeds apply exactly as they would had those tokens been emitted).

`verify` keeps the longest prefix of the draft equal to those tokens (`accept_greedy`) and
emits it, then the sampled token after it. For greedy rows that is the target's argmax. For
sampled rows it is rejection sampling with a one-hot draft (what the n-gram proposer is):
a draft token x is kept with probability p(x), and at the first rejection the emitted token
is distributed as p without x, renormalized; `verify.rejection_sample(draft_probs=None)`
has the same law. Drawing each position's token with the sampler's own noise for that
position also means a seeded request gets the very tokens it gets without speculation,
whatever the batch, k or the switch did (a separate acceptance uniform would not).

Emitted tokens then go through the output processor one by one (stops, max_tokens,
logprobs as without speculation); the KV slots of the rejected ones are released
(`KVCacheManager.truncate`, called by `Scheduler.update`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from lockgate.engine.kv_cache import KVCacheManager
from lockgate.engine.request import Sequence
from lockgate.engine.sampler import SamplerOutput
from lockgate.engine.spec.config import SpeculativeConfig
from lockgate.engine.spec.ngram import propose
from lockgate.engine.spec.switch import CostView, SpecSwitch
from lockgate.engine.spec.verify import accept_greedy
from lockgate.engine.stats import SpecClassStats, SpecStats

# (sequence, most tokens) -> draft tokens to follow its last one; tests swap in others
Proposer = Callable[[Sequence, int], list[int]]


class SpecDecoder:
    """One engine's speculative decoding: its proposer, switch and counters."""

    def __init__(self, config: SpeculativeConfig, kv: KVCacheManager, classes: tuple[str, ...],
                 max_seq_len_by_rank: list[int]) -> None:
        self.config = config
        self.num_spec = config.num_speculative_tokens
        self.kv = kv
        self.classes = classes
        self.max_seq_len_by_rank = max_seq_len_by_rank
        self.switch = SpecSwitch(len(classes), self.num_spec, auto=config.auto_disable)
        self.counts = [SpecClassStats(accepted_per_pos=[0] * self.num_spec) for _ in classes]
        self.proposer: Proposer = self.ngram
        self.prefill_reserve = 0       # this step's tokens kept from drafts for pending prefill

    def ngram(self, seq: Sequence, k: int) -> list[int]:
        cfg = self.config
        return propose(seq.token_ids, k, cfg.prompt_lookup_min or 1, cfg.prompt_lookup_max or 1)

    def begin(self, running: list[Sequence], waiting: Iterable[Sequence], cost: CostView,
              max_num_batched_tokens: int) -> None:
        """A step is being scheduled: the switch decides each class's drafts, and the budget
        that pending prefill keeps from drafts is set: its tokens, up to half the budget (a
        prompt's token is certain work, a draft token a guess; decodes are scheduled first,
        so without this a batch of drafting decodes could hold every arrival back)."""
        self.switch.begin(running, cost)
        pending = sum(s.num_pending_tokens for s in running if not s.is_decode)
        pending += sum(s.num_tokens - s.num_computed_tokens for s in waiting)
        self.prefill_reserve = min(pending, max_num_batched_tokens // 2)

    def try_drafts(self, seq: Sequence, tokens_left: int, reserve: int) -> list[int]:
        """Draft tokens for decode `seq`, blocks for them allocated (leaving `reserve` free);
        [] when it gets none, or they do not fit the free blocks (drafts preempt no one).
        `tokens_left`: the step's budget, less a token for each decode still to come."""
        k = self._room(seq, tokens_left - self.prefill_reserve)
        if k < 1:
            return []
        drafts = list(self.proposer(seq, k))[:k]
        if drafts and self.kv.try_allocate(seq, 1 + len(drafts), reserve=reserve):
            return drafts
        return []

    def _room(self, seq: Sequence, tokens_left: int) -> int:
        """How many draft tokens `seq` may carry this step (0: none)."""
        rank = seq.state.class_rank
        p = seq.params
        if not (self.switch.enabled[rank] and p.speculative) or p.structured_outputs is not None:
            return 0
        # every emitted token must fit: the budget, the class's context and max_tokens
        k = min(self.num_spec, tokens_left - 1, self.max_seq_len_by_rank[rank] - seq.num_tokens - 1)
        if p.max_tokens is not None:
            k = min(k, p.max_tokens - seq.num_output_tokens - 1)
        return k

    def verify(self, seqs: list[Sequence], out: SamplerOutput, drafts: dict[Sequence, list[int]],
               ) -> tuple[list[Sequence], SamplerOutput, dict[Sequence, int]]:
        """The runner's rows (`seqs` in its order; 1 + len(drafts) rows for a decode with
        drafts) -> the tokens to emit, one (sequence, token) pair each in order, as the
        output processor takes them, and how many drafts each drafted sequence kept."""
        spec_seqs = [s for s in seqs if s in drafts]
        kept = self._accepted(seqs, out, spec_seqs, drafts)
        flat_seqs: list[Sequence] = []
        flat = SamplerOutput([], [])
        accepted: dict[Sequence, int] = {}
        row = 0
        for seq in seqs:
            draft = drafts.get(seq)
            if draft is None:
                num_emit, num_rows = 1, 1
            else:
                accepted[seq] = kept[seq]
                num_emit, num_rows = kept[seq] + 1, len(draft) + 1
                self._count(seq.state.class_rank, len(draft), kept[seq])
            flat_seqs += [seq] * num_emit
            flat.token_ids += out.token_ids[row:row + num_emit]
            flat.logprobs += out.logprobs[row:row + num_emit]
            row += num_rows
        return flat_seqs, flat, accepted

    @staticmethod
    def _accepted(seqs: list[Sequence], out: SamplerOutput, spec_seqs: list[Sequence],
                  drafts: dict[Sequence, list[int]]) -> dict[Sequence, int]:
        """`accept_greedy` over the drafted rows at once: drafts and sampled tokens padded to
        the longest draft."""
        if not spec_seqs:
            return {}
        width = max(len(drafts[s]) for s in spec_seqs)
        draft = torch.zeros(len(spec_seqs), width, dtype=torch.long)
        target = torch.full((len(spec_seqs), width + 1), -1, dtype=torch.long)
        first_row, row = {}, 0
        for seq in seqs:
            first_row[seq] = row
            row += 1 + len(drafts.get(seq, ()))
        for i, seq in enumerate(spec_seqs):
            d = drafts[seq]
            draft[i, :len(d)] = torch.tensor(d)
            target[i, :len(d) + 1] = torch.tensor(out.token_ids[first_row[seq]:first_row[seq] + len(d) + 1])
        num_draft = torch.tensor([len(drafts[s]) for s in spec_seqs])
        accepted, _ = accept_greedy(draft, target, num_draft)
        return dict(zip(spec_seqs, accepted.tolist(), strict=True))

    def _count(self, rank: int, num_draft: int, num_accepted: int) -> None:
        c = self.counts[rank]
        c.num_drafts += 1
        c.num_draft_tokens += num_draft
        c.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.accepted_per_pos[pos] += 1
        self.switch.observe(rank, num_draft, num_accepted)

    def stats(self) -> SpecStats:
        cfg = self.config
        out = SpecStats(cfg.method, self.num_spec, cfg.prompt_lookup_min or 1, cfg.prompt_lookup_max or 1,
                        cfg.auto_disable, accepted_per_pos=[0] * self.num_spec)
        for rank, (name, c) in enumerate(zip(self.classes, self.counts, strict=True)):
            row = SpecClassStats(
                enabled=self.switch.enabled[rank], num_drafts=c.num_drafts, num_draft_tokens=c.num_draft_tokens,
                num_accepted_tokens=c.num_accepted_tokens, accepted_per_pos=list(c.accepted_per_pos),
                acceptance_rate=c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else None,
                running_acceptance=self.switch.acceptance[rank])
            out.classes[name] = row
            out.num_drafts += c.num_drafts
            out.num_draft_tokens += c.num_draft_tokens
            out.num_accepted_tokens += c.num_accepted_tokens
            out.accepted_per_pos = [a + b for a, b in zip(out.accepted_per_pos, c.accepted_per_pos, strict=True)]
        return out

