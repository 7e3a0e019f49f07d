"""Speculative decoding in the step: draft tokens for decodes, and what the target keeps.

The scheduler asks `try_drafts` for each running decode: up to k tokens from the proposer
(engine/spec/ngram.py; with a draft model, k slots whose tokens the draft writes in the runner
before the target's forward: engine/spec/draft_model.py), fewer where the step's token
budget, the step-time target, `max_tokens` or the context its class may use leave less room, none for a request
that opted out (`speculative=False`), one with a grammar (its matcher would have to follow
the draft: such rows decode a token a step for now), or a class the switch
(engine/spec/switch.py) has turned off. A row with a LoRA adapter drafts too: its chunk is
one more segment of its adapter's tokens. The row then computes its last token and
the drafts as one short chunk over the paged KV cache; the runner samples a token at each of
its 1 + d positions, the row at position j seeing the drafts before it as its history (so
penalties, logit bias and seeds apply exactly as they would had those tokens been emitted).

Drafts never make a step longer than its step-time target (engine/step_sizing.py): where steps
are sized, a row's draft is cut to what the time left under the target (after the step's plain
decodes) still pays for, and decodes are scheduled most urgent class first, so when the target
or the token budget is tight the less urgent class loses its drafts before the online class's.

`verify` keeps the longest prefix of the draft equal to those tokens (`accept_greedy`) and
emits it, then the sampled token after it. For greedy rows that is the target's argmax. For
sampled rows it is rejection sampling with a one-hot draft (what the n-gram proposer is):
a draft token x is kept with probability p(x), and at the first rejection the emitted token
is distributed as p without x, renormalized; `verify.rejection_sample(draft_probs=None)`
has the same law. Drawing each position's token with the sampler's own noise for that
position also means a seeded request gets the very tokens it gets without speculation,
whatever the batch, k or the switch did (a separate acceptance uniform would not).

A draft model's sampled rows are verified in the runner instead, by rejection sampling against
the draft's own distribution (`SamplerOutput.accepted_at` says how many each kept).

Emitted tokens then go through the output processor one by one (stops, max_tokens,
logprobs as without speculation); the KV slots of the rejected ones are released
(`KVCacheManager.truncate`, called by `Scheduler.update`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from lockgate.engine.cost_model import StepCostModel, StepShape
from lockgate.engine.kv_cache import KVCacheManager
from lockgate.engine.request import Sequence
from lockgate.engine.sampler import SamplerOutput
from lockgate.engine.spec.config import SpeculativeConfig
from lockgate.engine.spec.ngram import propose
from lockgate.engine.spec.switch import SpecSwitch
from lockgate.engine.spec.verify import accept_greedy
from lockgate.engine.stats import SpecClassStats, SpecStats

if TYPE_CHECKING:
    from lockgate.engine.step_sizing import StepSizer

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
        self.proposer: Proposer = self.ngram if config.draft_model is None else self.placeholder
        self.prefill_reserve = 0       # this step's tokens kept from drafts for pending prefill
        self.time_left: float | None = None   # seconds drafts may still add to the step (None: unbounded)
        self.cost = StepCostModel()

    def ngram(self, seq: Sequence, k: int) -> list[int]:
        cfg = self.config
        return propose(seq.token_ids, k, cfg.prompt_lookup_min or 1, cfg.prompt_lookup_max or 1)

    @staticmethod
    def placeholder(seq: Sequence, k: int) -> list[int]:
        """A draft model's proposer here: k slots, the tokens written by the runner's draft."""
        return [0] * k

    def begin(self, running: list[Sequence], waiting: Iterable[Sequence], sizer: StepSizer,
              max_num_batched_tokens: int) -> None:
        """A step is being scheduled: the switch decides each class's drafts, the time drafts
        may add to the step is set (`StepSizer.draft_room_s`), and the budget that pending
        prefill keeps from drafts: its tokens, up to half the budget (a prompt's token is
        certain work, a draft token a guess; decodes are scheduled first, so without this a
        batch of drafting decodes could hold every arrival back)."""
        self.cost = sizer.cost
        self.switch.begin(running, self.cost)
        self.time_left = sizer.draft_room_s(running)
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
        # proposed first: a row with nothing to propose (text that quotes nothing) costs
        # its search alone, not the cost model's pricing too
        drafts = list(self.proposer(seq, k))[:k]
        if drafts and self.time_left is not None:
            drafts = drafts[:self._held(seq, len(drafts), self.time_left)]
        if drafts and self.kv.try_allocate(seq, 1 + len(drafts), reserve=reserve):
            if self.time_left is not None:
                self.time_left -= self._extra_s(seq, len(drafts))
            return drafts
        return []

    def _extra_s(self, seq: Sequence, num_draft: int) -> float:
        """Seconds decode `seq` adds to the step as a chunk of 1 + `num_draft` tokens rather
        than as a plain decode (the fitted step-cost model's difference)."""
        plain, verify = StepShape(), StepShape()
        plain.add_decode(seq.num_tokens)
        verify.add_verify(1 + num_draft, seq.num_tokens - 1)
        return max(0.0, (self.cost.predict(verify) or 0.0) - (self.cost.predict(plain) or 0.0))

    def _held(self, seq: Sequence, k: int, seconds: float) -> int:
        """The most draft tokens, at most `k`, that keep `seq`'s extra time within `seconds`."""
        if self._extra_s(seq, k) <= seconds:
            return k
        lo, hi = 0, k     # extra time grows with the draft: fits at lo, not at hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._extra_s(seq, mid) <= seconds else (lo, mid)
        return lo

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
        kept = dict(zip(spec_seqs, accepted.tolist(), strict=True))
        for seq in spec_seqs:    # rows the runner verified against a draft model's q
            if first_row[seq] in out.accepted_at:
                kept[seq] = out.accepted_at[first_row[seq]]
        return kept

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
        out = SpecStats(cfg.method or "ngram", self.num_spec, cfg.prompt_lookup_min or 1, cfg.prompt_lookup_max or 1,
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

