"""Step sizing: how much prefill each class may put into the step being scheduled.

Under `priority` with chunked prefill, the step's *urgent* class is the most urgent one with
work in sight (sequences running or waiting, or an arrival within `urgent_window_s`). A step
in which the urgent classes compute prompt tokens (an arrival's first token) runs only their
work: their decodes and prefill, nothing less urgent (never two such steps in a row). In any
other step less urgent prefill fills the step only while the step-cost model
(engine/cost_model.py) predicts it within the step-time target: the urgent class's `slo`
when set, else the larger of `step_time_multiple` (1.0) x the predicted time of the step's
decodes (every running one: the pace the streams already keep) and the urgent class's own
part plus a chunk of `max_num_batched_tokens / 16` tokens. So no step is longer than the decodes make it: where
the decodes leave no room for such a chunk and less urgent prefill is pending, the step is
a *background prefill* step instead (once enough is pending to fill it, or it has waited
`BACKGROUND_PREFILL_WAIT` steps), in which the less urgent decodes sit out and their
prefill fills the same target (Sarathi-Serve's stall-free batching, with the less urgent
decodes and prefill taking turns instead of sharing one longer step). Less urgent decodes
sit out at most two steps in a row (a background prefill step, then an arrival's own). With
no urgent work in sight, steps use the whole budget.
An explicit `prefill_token_budget` for a class replaces its sizing with that fixed cap, and
such a class computes no prefill in a step where a more urgent class does.
"""

from __future__ import annotations

import time
from typing import Protocol

from lockgate.engine.config import EngineConfig
from lockgate.engine.cost_model import StepCostModel, StepShape
from lockgate.engine.request import Sequence
from lockgate.engine.stats import CostModelStats

# less urgent prefill per step while the cost model has not yet seen enough steps to predict
FALLBACK_BACKGROUND_PREFILL = 256
# steps pending less urgent prefill waits, beside decodes that leave it no room, before it
# gets a background prefill step that it does not fill
BACKGROUND_PREFILL_WAIT = 4


class QueueView(Protocol):
    """What step sizing reads of its scheduler at the start of a step: the running and
    waiting sequences, whether admission is paused, which classes (by rank) have work, and
    whether an adapter is loaded. The Scheduler is one."""

    running: list[Sequence]
    waiting: list[Sequence]
    admission_paused: bool

    def class_active(self, rank: int) -> bool: ...

    def lora_ready(self, lora_id: int) -> bool: ...


class StepSizer:
    """The sizing state of one scheduler: fixed settings, and per step (`begin`) the urgent
    class, the prefill left to each capped class, the step's shape and its time target."""

    def __init__(self, config: EngineConfig, block_size: int) -> None:
        classes = config.service_classes
        self.num_classes = len(classes)
        self.block_size = block_size
        self.cost = StepCostModel()
        self.enabled = config.scheduling_policy == "priority" and config.enable_chunked_prefill
        self.step_time_multiple = config.step_time_multiple
        self.min_background_chunk = max(block_size, config.max_num_batched_tokens // 16)
        self.urgent_window_s = config.urgent_window_s
        self.step_target_by_rank = [config.step_target_s(c) for c in classes]
        self.class_names = list(classes)
        self.last_arrival = [-float("inf")] * len(classes)   # time.monotonic()
        # per-step cap on each class's prefill tokens (chunked prefill only): keeps steps short
        # while background prefill runs, so an online arrival never waits behind a long one
        self.prefill_cap_by_rank = [
            config.prefill_token_budget.get(c) if config.enable_chunked_prefill else None
            for c in classes
        ]
        self.prefill_left: list[int | None] = list(self.prefill_cap_by_rank)
        self.min_prefill_rank = len(classes)    # the most urgent class prefilling this step
        self.shape = StepShape()
        self.urgent_rank = len(classes)
        self.target: float | None = None
        self.background_tokens = 0
        self.skip_background_decodes = False
        self.skipped_decodes = False            # the last step left less urgent decodes out
        self.last_skip_was_arrival = False      # ... and it was an arrival's own step
        self.background_prefill_step = False    # this step: less urgent prefill instead of decodes
        self.steps_since_background = 0         # steps since the last background prefill step
        self.no_forced_block = False            # background prefill steps move it: no block here
        self.urgent_shape = StepShape()         # the urgent classes' part of the step

    def arrival(self, rank: int) -> None:
        self.last_arrival[rank] = time.monotonic()

    def cost_summary(self, device: str) -> CostModelStats:
        """The step-cost model's fit, with the step-time targets steps are sized to: each
        class's own, and the latest step's (its urgent class and target)."""
        out = self.cost.summary(device)
        out.step_targets = dict(zip(self.class_names, self.step_target_by_rank, strict=True))
        rank = self.urgent_rank
        out.last_urgent_class = self.class_names[rank] if rank < self.num_classes else None
        out.last_step_target_s = self.target
        return out

    def begin(self, sched: QueueView) -> None:
        """Reset for a new step of `sched`: find the urgent class, and whether this step is
        the one that gives urgent work its prompt (and so carries no less urgent work)."""
        self.prefill_left = list(self.prefill_cap_by_rank)
        self.min_prefill_rank = self.num_classes
        self.shape = StepShape()
        self.urgent_shape = StepShape()
        self.urgent_rank = self._urgent_class(sched) if self.enabled else self.num_classes
        self.target = None
        self.background_tokens = 0
        # the step that gives urgent work its prompt (an arrival's first token) carries no
        # less urgent work at all: that step is the person's time to first token. Never two
        # such steps running, so a stream of urgent prompts cannot stop less urgent decodes;
        # a background prefill step only follows a step that ran them. So less urgent
        # decodes sit out at most two steps in a row (a background prefill step, then an
        # arrival's).
        arrival_ok = self.enabled and not (self.skipped_decodes and self.last_skip_was_arrival)
        self.skip_background_decodes = arrival_ok and self._urgent_prefill_pending(sched)
        self.last_skip_was_arrival = self.skip_background_decodes
        self.background_prefill_step = False
        self.no_forced_block = False
        if (self.enabled and not self.skipped_decodes and not self.skip_background_decodes
                and self.urgent_rank < self.num_classes):
            self._plan_background_prefill(sched)
        self.steps_since_background = 0 if self.background_prefill_step else self.steps_since_background + 1
        self.skipped_decodes = False

    def _plan_background_prefill(self, sched: QueueView) -> None:
        """Make this a background prefill step when the running decodes fill the step-time
        target (no room for a chunk of less urgent prefill beside them) and less urgent
        prefill is pending: the less urgent decodes sit out, their prefill fills the target."""
        cost = self.cost
        capped = any(c is not None for c in self.prefill_cap_by_rank[self.urgent_rank + 1:])
        if not cost.ready or capped:     # an explicit prefill_token_budget rules instead
            return
        decodes, urgent = StepShape(), StepShape()
        background = False
        for seq in sched.running:
            if seq.is_decode:
                decodes.add_decode(seq.num_tokens)
                if seq.state.class_rank <= self.urgent_rank:
                    urgent.add_decode(seq.num_tokens)
                else:
                    background = True
        pending = self._background_prefill_pending(sched) if background else 0
        if pending == 0:
            return
        target = self._target(decodes, urgent)
        room = cost.prefill_room(target - (cost.predict(decodes) or 0.0), 0)
        if room >= self.min_background_chunk:
            return
        self.no_forced_block = True     # progress comes from background prefill steps instead
        # a step of its own costs the step's fixed part once more: taken when the pending
        # prefill fills it, or when it has waited BACKGROUND_PREFILL_WAIT steps
        full = cost.prefill_room(target - (cost.predict(urgent) or 0.0), 0)
        if pending >= full or self.steps_since_background >= BACKGROUND_PREFILL_WAIT:
            self.skip_background_decodes = True
            self.background_prefill_step = True
            self.target = target

    def cancel_background_prefill_step(self) -> None:
        """This step's background prefill found nothing it could start: it runs the less
        urgent decodes instead (and counts as a step that ran them)."""
        self.background_prefill_step = False
        self.skip_background_decodes = False
        self.skipped_decodes = False

    def _background_prefill_pending(self, sched: QueueView) -> int:
        """Prompt tokens that classes less urgent than the step's urgent one have to compute
        (running prefills, and waiting sequences unless admission is paused)."""
        urgent = self.urgent_rank
        tokens = sum(s.num_pending_tokens for s in sched.running
                     if s.state.class_rank > urgent and not s.is_decode)
        if not sched.admission_paused:
            tokens += sum(s.num_tokens - s.num_computed_tokens for s in sched.waiting
                          if s.state.class_rank > urgent)
        return tokens

    def _target(self, decodes: StepShape, urgent: StepShape) -> float:
        """The step-time target: the urgent class's `slo` when set, else the larger of
        `step_time_multiple` x the step's decodes (and urgent prefill) and the urgent part
        plus a chunk of `min_background_chunk` tokens (less urgent prefill keeps moving at a
        useful rate even beside a single urgent decode)."""
        explicit = self.step_target_by_rank[self.urgent_rank]
        if explicit is not None:
            return explicit
        cost = self.cost
        predicted, own, chunk = cost.predict(decodes), cost.predict(urgent), cost.chunk_time(self.min_background_chunk)
        if predicted is None or own is None or chunk is None:
            raise RuntimeError("cost model: predicts a step but not its parts")
        return max(self.step_time_multiple * predicted, own + chunk)

    def draft_room_s(self, running: list[Sequence]) -> float | None:
        """Seconds draft tokens may add to this step (speculative decoding): its step-time
        target, fixed here from the decodes that run as plain decodes (so drafts cannot raise
        it, and less urgent prefill is then sized to the same one), less their predicted time.
        None where steps are not sized (no urgent class in sight, or the cost model unfitted)."""
        if not self.enabled or self.urgent_rank >= self.num_classes or not self.cost.ready:
            return None
        decodes, urgent = StepShape(), StepShape()
        for seq in running:
            rank = seq.state.class_rank
            if seq.is_decode and not (self.skip_background_decodes and rank > self.urgent_rank):
                decodes.add_decode(seq.num_tokens)
                if rank <= self.urgent_rank:
                    urgent.add_decode(seq.num_tokens)
        if self.target is None:
            self.target = self._target(decodes, urgent)
        return max(0.0, self.target - (self.cost.predict(decodes) or 0.0))

    @property
    def urgent_class(self) -> int | None:
        return self.urgent_rank if self.urgent_rank < self.num_classes else None

    def skips_decode(self, seq: Sequence) -> bool:
        """Is this less urgent decode left out of the step (see `begin`)?"""
        if self.skip_background_decodes and seq.state.class_rank > self.urgent_rank:
            self.skipped_decodes = True
            return True
        return False

    def room(self, seq: Sequence, tokens_left: int) -> int:
        """Prefill tokens `seq` may take this step: the budget, within its class's cap or, for
        a class less urgent than the step's urgent one, within the step-time target. A class
        with an explicit cap computes no prefill in a step where a more urgent class does:
        that step gives an arriving request its first token, and is kept short."""
        rank = seq.state.class_rank
        if seq.is_decode and self.skip_background_decodes and rank > self.urgent_rank:
            return 0     # a decode sitting this step out does not come back as a 1-token chunk
        left = self.prefill_left[rank]
        if left is not None:
            if rank > self.min_prefill_rank:
                return 0
            return min(left, tokens_left)
        if rank <= self.urgent_rank or not self.enabled:
            return tokens_left
        return min(tokens_left, self._background_room(seq))

    def _background_room(self, seq: Sequence) -> int:
        """Prefill tokens a sequence of a class less urgent than the step's urgent one may
        take: none in a step where a more urgent class prefills (that step gives an arrival
        its first token), else what the cost model predicts fits the step-time target."""
        if self.min_prefill_rank < seq.state.class_rank:
            return 0
        cost = self.cost
        predicted = cost.predict(self.shape)    # None until the cost model is fitted
        if predicted is None:
            return max(0, FALLBACK_BACKGROUND_PREFILL - self.background_tokens)
        if self.target is None:   # fixed at the first less urgent chunk: the urgent part is known
            self.target = self._target(self.shape, self.urgent_shape)
        room = cost.prefill_room(self.target - predicted, seq.num_computed_tokens)
        if self.background_tokens == 0 and not self.no_forced_block:
            room = max(room, self.block_size)   # background work always moves, a block at least
        return room

    def _urgent_prefill_pending(self, sched: QueueView) -> bool:
        """Has the urgent class prompt tokens to compute that can start this step? (A waiting
        sequence whose adapter is still being read, or any while admission is paused, cannot.)"""
        urgent = self.urgent_rank
        if urgent >= self.num_classes or not any(sched.class_active(r) for r in range(urgent + 1)):
            return False
        if any(s.state.class_rank <= urgent and not s.is_decode for s in sched.running):
            return True
        if sched.admission_paused:
            return False
        return any(s.state.class_rank <= urgent
                   and (not s.state.req.lora_id or sched.lora_ready(s.state.req.lora_id))
                   for s in sched.waiting)

    def _urgent_class(self, sched: QueueView) -> int:
        """The most urgent class with work in sight: sequences running or waiting, or an
        arrival within `urgent_window_s`."""
        now = time.monotonic()
        for rank in range(self.num_classes):
            if sched.class_active(rank) or now - self.last_arrival[rank] <= self.urgent_window_s:
                return rank
        return self.num_classes

    def add(self, seq: Sequence, num_tokens: int, sign: int = 1) -> None:
        """Count `seq`'s `num_tokens` into the step's shape (`sign` -1: take them out)."""
        urgent = seq.state.class_rank <= self.urgent_rank
        if seq.is_decode and num_tokens == 1:
            self.shape.add_decode(seq.num_tokens, sign)
            if urgent:
                self.urgent_shape.add_decode(seq.num_tokens, sign)
        elif seq.is_decode:      # with draft tokens: a decode still, computed as a short chunk
            for shape in (self.shape, self.urgent_shape) if urgent else (self.shape,):
                shape.add_verify(num_tokens, seq.num_computed_tokens, sign)
        else:
            done = seq.num_computed_tokens + num_tokens >= seq.num_tokens
            self.shape.add_prefill(num_tokens, seq.num_computed_tokens, done, sign)
            if urgent:
                self.urgent_shape.add_prefill(num_tokens, seq.num_computed_tokens, done, sign)
            else:
                self.background_tokens += sign * num_tokens

    def charge_prefill(self, rank: int, num_tokens: int) -> None:
        """`num_tokens` of prefill of class `rank` went into the step (negative: a refund)."""
        left = self.prefill_left[rank]
        if left is not None:
            self.prefill_left[rank] = left - num_tokens
        if num_tokens > 0 and rank < self.min_prefill_rank:
            self.min_prefill_rank = rank
