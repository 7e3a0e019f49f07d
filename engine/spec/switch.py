"""When draft tokens pay: per step and service class, speculation on or off.

A decode row that carries d draft tokens is computed as a chunk of 1 + d tokens, and wins
the tokens of the draft it keeps. With a few rows in the step (the device waits on memory,
and the step's fixed cost dominates) that is nearly free; with many (the device computes)
each draft token costs about what a decode row's token does, and rejected ones are waste.

The rule, from the fitted step-cost model (engine/cost_model.py) and the class's running
acceptance: drafts stay on for a class while the extra time of one of its rows as a 1 + d
token chunk rather than a decode is at most what its expected accepted tokens (the running
rate x d) are worth at the step's plain rate (the predicted time of the step's decodes per
decode). With many rows that plain rate tends to a decode row's own cost: off when a 1 + d
token row costs more than 1 + expected accepted plain rows. Before the cost model is fitted,
and with `auto_disable` false, drafts are on. A class switched off drafts again one step in
`PROBE_EVERY`, so its acceptance keeps being measured (the text it quotes may change).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from lockgate.engine.cost_model import StepShape
from lockgate.engine.request import Sequence

PROBE_EVERY = 16        # steps a switched-off class waits before it drafts again, once
_DECAY = 0.9            # the running averages: each new row weighs 1 - _DECAY


class CostView(Protocol):
    def predict(self, shape: StepShape) -> float | None: ...


class SpecSwitch:
    """Per class (by rank): `enabled` for the step being scheduled, the running acceptance
    (accepted draft tokens per draft token) and draft length (draft tokens per drafted row)."""

    def __init__(self, num_classes: int, num_spec: int, *, auto: bool = True) -> None:
        self.auto = auto
        self.enabled = [True] * num_classes
        # optimistic to start: a class drafts until its rows say drafts do not pay
        self.acceptance = [1.0] * num_classes
        self.draft_len = [float(num_spec)] * num_classes
        self.steps_off = [0] * num_classes

    def observe(self, rank: int, num_draft: int, num_accepted: int) -> None:
        """One verified row of class `rank`: `num_accepted` of its `num_draft` kept."""
        if num_draft < 1:
            return
        self.acceptance[rank] = _DECAY * self.acceptance[rank] + (1 - _DECAY) * num_accepted / num_draft
        self.draft_len[rank] = _DECAY * self.draft_len[rank] + (1 - _DECAY) * num_draft

    def begin(self, running: Iterable[Sequence], cost: CostView) -> None:
        """Decide each class's drafts for the step being scheduled over `running`."""
        if not self.auto:
            return
        plain = StepShape()
        rows = [0] * len(self.enabled)
        context = [0] * len(self.enabled)
        for seq in running:
            if seq.is_decode:
                plain.add_decode(seq.num_tokens)
                rank = seq.state.class_rank
                rows[rank] += 1
                context[rank] += seq.num_tokens
        plain_s = cost.predict(plain)
        for rank, num_rows in enumerate(rows):
            if num_rows == 0:
                continue
            pays = plain_s is None or self.pays(rank, context[rank] // num_rows, plain_s / plain.num_seqs, cost)
            self.steps_off[rank] = 0 if pays else self.steps_off[rank] + 1
            self.enabled[rank] = pays or self.steps_off[rank] % PROBE_EVERY == 0

    def pays(self, rank: int, context: int, per_row_s: float, cost: CostView) -> bool:
        """Does a row of class `rank` with `context` tokens win more by its draft than the
        draft costs, at `per_row_s` seconds a decode row's token (the step's plain rate)?"""
        num_draft = max(1, round(self.draft_len[rank]))
        decode, verify = StepShape(), StepShape()
        decode.add_decode(context)
        verify.add_verify(1 + num_draft, context - 1)
        decode_s, verify_s = cost.predict(decode), cost.predict(verify)
        if decode_s is None or verify_s is None:
            return True
        return verify_s - decode_s <= self.acceptance[rank] * num_draft * per_row_s
