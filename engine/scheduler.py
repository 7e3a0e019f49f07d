"""The step scheduler: which sequences run this step, how many tokens each, who is preempted.

One token budget (`max_num_batched_tokens`) and one sequence cap (`max_num_seqs`) per step.
Every running decode comes first, in policy order; then prefill chunks of running and
waiting sequences together, in policy order.

`priority` orders by service class; inside a class, by tenant fairness (virtual token
counters as in VTC, OSDI'24: the backlogged tenant with the least weighted service goes
next); inside a tenant, by the request's priority; then arrival. `fcfs` orders by arrival
alone. When blocks run out, the least urgent running sequence is preempted (blocks freed,
its cached prefix kept for its return, recomputed later, its place in line kept); a waiting
sequence may preempt running ones only of a less urgent class. `reserved_kv_fraction`
keeps a share of the blocks out of reach of less urgent classes. With LoRA on, at most
`max_loras` adapters run at once, and adapters take turns (`_lora_admissible`).

Step sizing (under `priority`, with chunked prefill): the step's *urgent* class is the most
urgent one with work in sight (sequences running or waiting, or an arrival within
`urgent_window_s`). A step in which the urgent classes compute prompt tokens (an arrival's
first token) runs only their work: their decodes and prefill, nothing less urgent (never
two such steps in a row, so less urgent decodes keep moving). In any other step every
running decode runs, and less urgent prefill fills the step only while the step-cost model
(engine/cost_model.py) predicts it within the urgent class's step-time target: its `slo`
when set, else `step_time_multiple` x the predicted time of the step's urgent part (and at
least that part plus a chunk of `max_num_batched_tokens / 16` tokens).
So an arrival waits at most for one short step in flight, then gets a step of its own; with
no urgent work in sight, steps use the whole budget. An explicit `prefill_token_budget` for
a class replaces its sizing with that fixed cap.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.cost_model import StepCostModel, StepShape
from engine.kv_cache import KVBlock, KVCacheManager
from engine.request import RequestState, Sequence, SeqStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepBudget:
    tokens_left: int
    num_tokens: int = 0

    def take(self, num_tokens: int) -> None:
        assert 0 < num_tokens <= self.tokens_left
        self.tokens_left -= num_tokens
        self.num_tokens += num_tokens

    def give_back(self, num_tokens: int) -> None:
        self.tokens_left += num_tokens
        self.num_tokens -= num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    # (sequence, tokens to compute this step): running decodes first, then prefill chunks
    scheduled: list[tuple[Sequence, int]]
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    shape: StepShape = field(default_factory=StepShape)   # what the cost model predicts from
    urgent_class: int | None = None      # rank of the class the step was sized for
    step_target_s: float | None = None   # its step-time target, when less urgent prefill was sized

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


PREFILL_COST = 1   # service per uncached prompt token computed
DECODE_COST = 2    # service per output token (VTC's w_q)
# less urgent prefill per step while the cost model has not yet seen enough steps to predict
FALLBACK_BACKGROUND_PREFILL = 256


class Fairness:
    """Virtual token counters per (class, tenant): service / weight.

    A tenant is active in a class while it has sequences there (waiting or running). A
    tenant that becomes active starts at the least counter among the active tenants of its
    class (or at the class's high-water mark when none is), so idle time banks no credit.
    """

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = weights if weights is not None else {}
        self.counters: dict[int, dict[str, float]] = defaultdict(dict)
        self.active: dict[int, dict[str, int]] = defaultdict(dict)
        self.high_water: dict[int, float] = defaultdict(float)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def counter(self, rank: int, tenant: str) -> float:
        return self.counters[rank].get(tenant, 0.0)

    def activate(self, rank: int, tenant: str, num: int = 1) -> None:
        active = self.active[rank]
        if active.get(tenant, 0) == 0:
            others = [self.counters[rank].get(t, 0.0) for t, n in active.items() if n > 0]
            floor = min(others) if others else self.high_water[rank]
            self.counters[rank][tenant] = max(self.counter(rank, tenant), floor)
        active[tenant] = active.get(tenant, 0) + num

    def deactivate(self, rank: int, tenant: str) -> None:
        active = self.active[rank]
        active[tenant] -= 1
        if active[tenant] <= 0:
            del active[tenant]

    def charge(self, rank: int, tenant: str, service: float) -> None:
        c = self.counter(rank, tenant) + service / self.weight(tenant)
        self.counters[rank][tenant] = c
        if c > self.high_water[rank]:
            self.high_water[rank] = c

    def backlogged(self, rank: int) -> dict[str, float]:
        """Counters of the tenants active in class `rank`."""
        return {t: self.counter(rank, t) for t, n in self.active[rank].items() if n > 0}


@dataclass(slots=True)
class TenantStats:
    preemptions: int = 0
    prefill_tokens: int = 0     # computed (uncached) prompt tokens, recomputation included
    decode_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens served from the prefix cache at admission


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager,
                 weights: dict[str, float] | None = None) -> None:
        self.kv = kv
        self.block_size = kv.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.policy = config.scheduling_policy
        self.classes = config.service_classes
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.fair = Fairness(weights)
        num_blocks = kv.pool.num_blocks
        frac = config.reserved_kv_fraction
        # blocks a sequence of class rank r must leave free: the shares of more urgent classes
        self.reserve_by_rank = [
            sum(int(frac.get(c, 0.0) * num_blocks) for c in self.classes[:r])
            for r in range(len(self.classes))
        ]
        # per-step cap on each class's prefill tokens (chunked prefill only): keeps steps short
        # while background prefill runs, so an online arrival never waits behind a long one
        self.prefill_cap_by_rank = [
            config.prefill_token_budget.get(c) if self.chunked_prefill else None for c in self.classes
        ]
        self._prefill_left: list[int | None] = list(self.prefill_cap_by_rank)
        self._min_prefill_rank = len(self.classes)
        # step sizing from the measured cost model (see the module docstring)
        self.cost = StepCostModel()
        self.sizing = self.policy == "priority" and self.chunked_prefill
        self.step_time_multiple = config.step_time_multiple
        self.min_background_chunk = max(self.block_size, config.max_num_batched_tokens // 16)
        self.urgent_window_s = config.urgent_window_s
        self.step_target_by_rank = [config.step_target_s(c) for c in self.classes]
        self.last_arrival = [-float("inf")] * len(self.classes)   # time.monotonic()
        self._shape = StepShape()
        self._urgent_rank = len(self.classes)
        self._target: float | None = None
        self._background_tokens = 0
        self._skip_background_decodes = False
        self._skipped_decodes = False      # the last step left less urgent decodes out
        self.tenant_stats: dict[tuple[int, str], TenantStats] = defaultdict(TenantStats)
        self._step_charges: dict[Sequence, list[tuple[int, bool]]] = {}
        self._admitting = True
        # LoRA: at most max_loras distinct adapters among running sequences; an adapter
        # whose requests are queued is admitted only once it is in host memory
        self.max_loras = config.max_loras if config.enable_lora else 0
        self.lora_ready: Callable[[int], bool] = lambda _aid: True
        self._running_loras: set[int] = set()
        self._lora_gate: int | None = None
        # set by a model pool when this model's turn is over: running work finishes, nothing
        # new starts (so switching away preempts, and later recomputes, nothing)
        self.admission_paused = False

    def key(self, seq: Sequence) -> tuple:
        """Urgency, smallest first: under `priority` (class, tenant's counter, priority,
        arrival, sample); under `fcfs` (arrival, sample)."""
        if self.policy != "priority":
            return seq.fcfs_key
        st = seq.state
        return (st.class_rank, self.fair.counter(st.class_rank, st.req.tenant), st.req.priority,
                st.arrival_seq, seq.index)

    def reserve_for(self, seq: Sequence) -> int:
        return self.reserve_by_rank[seq.state.class_rank]

    def stats_of(self, seq: Sequence) -> TenantStats:
        return self.tenant_stats[(seq.state.class_rank, seq.state.req.tenant)]

    # -- queue changes ---------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        req = state.req
        if req.tenant_weight is not None:
            self.fair.weights[req.tenant] = float(req.tenant_weight)
        self.fair.activate(state.class_rank, req.tenant, len(state.seqs))
        self.last_arrival[state.class_rank] = time.monotonic()
        self.waiting.extend(state.seqs)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        self.fair.deactivate(seq.state.class_rank, seq.state.req.tenant)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    def _room(self, seq: Sequence, budget: StepBudget) -> int:
        """Prefill tokens `seq` may take this step: the budget, within its class's cap or, for
        a class less urgent than the step's urgent one, within the step-time target. A class
        with an explicit cap computes no prefill in a step where a more urgent class does:
        that step gives an arriving request its first token, and is kept short."""
        rank = seq.state.class_rank
        left = self._prefill_left[rank]
        if left is not None:
            if rank > self._min_prefill_rank:
                return 0
            return min(left, budget.tokens_left)
        if rank <= self._urgent_rank or not self.sizing:
            return budget.tokens_left
        return min(budget.tokens_left, self._background_room(seq))

    def _background_room(self, seq: Sequence) -> int:
        """Prefill tokens a sequence of a class less urgent than the step's urgent one may
        take: none in a step where a more urgent class prefills (that step gives an arrival
        its first token), else what the cost model predicts fits the step-time target."""
        if self._min_prefill_rank < seq.state.class_rank:
            return 0
        cost = self.cost
        if not cost.ready:
            return max(0, FALLBACK_BACKGROUND_PREFILL - self._background_tokens)
        if self._target is None:   # fixed at the first less urgent chunk: the urgent part is known
            explicit = self.step_target_by_rank[self._urgent_rank]
            if explicit is not None:
                self._target = explicit
            else:
                # a multiple of the urgent part, and never less than that part plus a
                # chunk of `min_background_chunk` tokens: less urgent prefill keeps moving
                # at a useful rate even beside a single urgent decode
                urgent = cost.predict(self._shape)
                self._target = max(self.step_time_multiple * urgent,
                                   urgent + cost.chunk_time(self.min_background_chunk))
        room = cost.prefill_room(self._target - cost.predict(self._shape), seq.num_computed_tokens)
        if self._background_tokens == 0:   # background work always moves, a block at least
            room = max(room, self.block_size)
        return room

    def _urgent_prefill_pending(self) -> bool:
        """Has the urgent class prompt tokens to compute that can start this step? (A waiting
        sequence whose adapter is still being read, or any while admission is paused, cannot.)"""
        urgent = self._urgent_rank
        if urgent >= len(self.classes) or not any(self.fair.active[r] for r in range(urgent + 1)):
            return False
        if any(s.state.class_rank <= urgent and not s.is_decode for s in self.running):
            return True
        if self.admission_paused:
            return False
        return any(s.state.class_rank <= urgent
                   and (not s.state.req.lora_id or self.lora_ready(s.state.req.lora_id))
                   for s in self.waiting)

    def _urgent_class(self) -> int:
        """The most urgent class with work in sight: sequences running or waiting, or an
        arrival within `urgent_window_s`."""
        now = time.monotonic()
        for rank in range(len(self.classes)):
            if self.fair.active[rank] or now - self.last_arrival[rank] <= self.urgent_window_s:
                return rank
        return len(self.classes)

    def _add_to_shape(self, seq: Sequence, num_tokens: int, sign: int = 1) -> None:
        if seq.is_decode and num_tokens == 1:
            self._shape.add_decode(seq.num_tokens, sign)
        else:
            done = seq.num_computed_tokens + num_tokens >= seq.num_tokens
            self._shape.add_prefill(num_tokens, seq.num_computed_tokens, done, sign)
            if seq.state.class_rank > self._urgent_rank:
                self._background_tokens += sign * num_tokens

    def _take(self, seq: Sequence, num_tokens: int, budget: StepBudget,
              scheduled: dict[Sequence, int], decode: bool) -> None:
        scheduled[seq] = num_tokens
        budget.take(num_tokens)
        self._add_to_shape(seq, num_tokens)
        self._charge(seq, num_tokens, decode=decode)

    def _charge(self, seq: Sequence, num_tokens: int, decode: bool, record: bool = True) -> None:
        """Count `num_tokens` of service to `seq`'s tenant (negative: a refund)."""
        st = self.stats_of(seq)
        if decode:
            st.decode_tokens += num_tokens
        else:
            st.prefill_tokens += num_tokens
            rank = seq.state.class_rank
            if self._prefill_left[rank] is not None:
                self._prefill_left[rank] -= num_tokens
            if num_tokens > 0 and rank < self._min_prefill_rank:
                self._min_prefill_rank = rank
        service = num_tokens * (DECODE_COST if decode else PREFILL_COST)
        if record:
            self._step_charges.setdefault(seq, []).append((num_tokens, decode))
        self.fair.charge(seq.state.class_rank, seq.state.req.tenant, service)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = StepBudget(self.max_num_batched_tokens)
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        self._step_charges = {}
        self._admitting = True
        self._prefill_left = list(self.prefill_cap_by_rank)
        self._min_prefill_rank = len(self.classes)   # the most urgent class prefilling this step
        self._shape = StepShape()
        self._urgent_rank = self._urgent_class() if self.sizing else len(self.classes)
        self._target = None
        self._background_tokens = 0
        # the step that gives urgent work its prompt (an arrival's first token) carries no
        # less urgent work at all: that step is the person's time to first token. Never two
        # steps running, so a stream of urgent prompts cannot stop less urgent decodes.
        self._skip_background_decodes = (self.sizing and not self._skipped_decodes
                                         and self._urgent_prefill_pending())
        self._skipped_decodes = False
        self._running_loras = {s.state.req.lora_id for s in self.running} - {0}
        self._lora_gate = None
        self.running.sort(key=self.key)
        self._schedule_decodes(budget, scheduled, preempted)
        self._schedule_prefills(budget, scheduled, preempted)
        items = list(scheduled.items())  # insertion order: decodes, then prefill chunks
        return SchedulerOutput(items, preempted, budget.num_tokens, self._shape,
                               self._urgent_rank if self._urgent_rank < len(self.classes) else None,
                               self._target)

    def _schedule_decodes(
        self, budget: StepBudget, scheduled: dict[Sequence, int], preempted: list[Sequence]
    ) -> None:
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or not seq.is_decode:
                continue
            if self._skip_background_decodes and seq.state.class_rank > self._urgent_rank:
                self._skipped_decodes = True
                continue
            if budget.tokens_left < 1:
                return
            if self._allocate_or_preempt(seq, 1, budget, scheduled, preempted):
                self._take(seq, 1, budget, scheduled, decode=True)

    def _schedule_prefills(
        self, budget: StepBudget, scheduled: dict[Sequence, int], preempted: list[Sequence]
    ) -> None:
        candidates = [s for s in self.running if s not in scheduled] + self.waiting
        if self.policy != "priority":
            for seq in sorted(candidates, key=self.key):
                if budget.tokens_left < 1:
                    return
                self._prefill_one(seq, budget, scheduled, preempted)
            return
        # class by class; inside a class the tenant with the least service goes next, its
        # most urgent sequence first; counters move as chunks are scheduled
        by_class: dict[int, dict[str, list[Sequence]]] = defaultdict(lambda: defaultdict(list))
        for seq in candidates:
            by_class[seq.state.class_rank][seq.state.req.tenant].append(seq)
        for rank in sorted(by_class):
            queues = {t: sorted(seqs, key=lambda q: (q.state.req.priority, q.state.arrival_seq, q.index),
                                reverse=True)
                      for t, seqs in by_class[rank].items()}
            while queues:
                if budget.tokens_left < 1:
                    return
                tenant = min(queues, key=lambda t: (self.fair.counter(rank, t), t))
                seq = queues[tenant].pop()
                if not queues[tenant]:
                    del queues[tenant]
                self._prefill_one(seq, budget, scheduled, preempted)

    def _prefill_one(
        self, seq: Sequence, budget: StepBudget, scheduled: dict[Sequence, int],
        preempted: list[Sequence],
    ) -> None:
        if seq.status is SeqStatus.RUNNING:
            # running prefills go on even once admission has stopped: they hold blocks
            # that an earlier waiting sequence may be waiting for
            if seq in scheduled or seq not in self.running:
                return
            num_new = min(seq.num_pending_tokens, self._room(seq, budget))
            if num_new < 1:
                return
            if self._allocate_or_preempt(seq, num_new, budget, scheduled, preempted):
                self._take(seq, num_new, budget, scheduled, decode=False)
        elif self._admitting and seq not in preempted and self._room(seq, budget) > 0:
            if self.admission_paused or not self._lora_admissible(seq):
                return
            admitted = self._try_admit(seq, budget, scheduled, preempted)
            if admitted is None:
                self._admitting = False   # keep the order: nothing later jumps the queue
            elif admitted:
                self._take(seq, admitted, budget, scheduled, decode=False)
                if seq.state.req.lora_id:
                    self._running_loras.add(seq.state.req.lora_id)

    def _lora_admissible(self, seq: Sequence) -> bool:
        """May this waiting sequence start, as far as adapters go? Base-model requests always
        may. An adapter's requests may while it holds one of the max_loras places or one is
        free. The first adapter (in policy order) refused a place becomes the step's *gate*:
        no other adapter's requests start until it has a place, so the adapters running now
        drain and the next place goes to it. Adapters thus take turns in queue order and a
        popular one cannot keep its place forever."""
        aid = seq.state.req.lora_id
        if not aid:
            return True
        if not self.lora_ready(aid):
            return False          # still being read from disk: the others go ahead
        if self._lora_gate is not None and self._lora_gate != aid:
            return False
        if aid in self._running_loras or len(self._running_loras) < self.max_loras:
            return True
        self._lora_gate = aid
        return False

    def _allocate_or_preempt(
        self,
        seq: Sequence,
        num_new: int,
        budget: StepBudget,
        scheduled: dict[Sequence, int],
        preempted: list[Sequence],
    ) -> bool:
        """Blocks for a running sequence, preempting the least urgent running ones (possibly
        itself) until they fit. False when `seq` itself was preempted."""
        reserve = self.reserve_for(seq)
        while not self.kv.try_allocate(seq, num_new, reserve=reserve):
            victim = max(self.running, key=self.key)
            self._preempt(victim, budget, scheduled, preempted)
            if victim is seq:
                return False
        return True

    def _try_admit(
        self,
        seq: Sequence,
        budget: StepBudget,
        scheduled: dict[Sequence, int],
        preempted: list[Sequence],
    ) -> int | None:
        """Move a waiting sequence to running with a first chunk. Returns the chunk's token
        count, 0 to skip it this step (a sibling waiting for its leader), None to stop
        admitting anything further this step."""
        shared = self._shareable_blocks(seq)
        if shared is None:
            return 0
        while len(self.running) >= self.max_num_seqs:
            if not self._preempt_less_urgent(seq, budget, scheduled, preempted):
                return None
        num_cached = len(shared) * self.block_size
        num_new = seq.num_tokens - num_cached
        if not self.chunked_prefill and seq.num_output_tokens == 0 and num_new > budget.tokens_left:
            return None
        seq.num_computed_tokens = num_cached   # what the room is sized from
        num_new = min(num_new, self._room(seq, budget))
        if num_new < 1:
            seq.num_computed_tokens = 0
            return None
        reserve = self.reserve_for(seq)
        while not self.kv.try_allocate(seq, num_new, shared, reserve=reserve):
            if not self._preempt_less_urgent(seq, budget, scheduled, preempted):
                seq.num_computed_tokens = 0
                return None
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.status = SeqStatus.RUNNING
        self.kv.record_lookup(seq.num_tokens, num_cached)
        state = seq.state
        if state.first_scheduled_time is None:
            state.first_scheduled_time = time.time()
            state.num_cached_tokens = num_cached
            self.stats_of(seq).cached_tokens += num_cached
        return num_new

    def _shareable_blocks(self, seq: Sequence) -> list[KVBlock] | None:
        """Filled blocks `seq` can adopt: its longest prefix-cache hit, or for sample i > 0
        its leader's prompt blocks (shared by reference, never copied). None: wait for the
        leader to finish its prompt first."""
        hits = self.kv.get_computed_blocks(seq)
        if seq.index == 0:
            return hits
        leader = seq.state.seqs[0]
        if leader.status is SeqStatus.FINISHED:
            return hits
        if leader.status is not SeqStatus.RUNNING or leader.num_computed_tokens < leader.num_prompt_tokens:
            return None
        bs = self.block_size
        num_shared = min(seq.num_prompt_tokens // bs, (seq.num_tokens - 1) // bs)
        from_leader = self.kv.blocks_of(leader)[:num_shared]
        return from_leader if len(from_leader) > len(hits) else hits

    def _preempt_less_urgent(
        self,
        seq: Sequence,
        budget: StepBudget,
        scheduled: dict[Sequence, int],
        preempted: list[Sequence],
    ) -> bool:
        """Under the priority policy, preempt the least urgent running sequence of a less
        urgent class than `seq`'s. False if there is none."""
        if self.policy != "priority":
            return False
        rank = seq.state.class_rank
        victims = [s for s in self.running if s.state.class_rank > rank]
        if not victims:
            return False
        self._preempt(max(victims, key=self.key), budget, scheduled, preempted)
        return True

    def _preempt(
        self,
        victim: Sequence,
        budget: StepBudget,
        scheduled: dict[Sequence, int],
        preempted: list[Sequence],
    ) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        if victim in scheduled:
            self._add_to_shape(victim, scheduled[victim], -1)
            budget.give_back(scheduled.pop(victim))
            for num, decode in self._step_charges.pop(victim, []):   # it will not run
                self._charge(victim, -num, decode, record=False)
        self.stats_of(victim).preemptions += 1
        victim.num_computed_tokens = 0
        victim.status = SeqStatus.PREEMPTED
        victim.num_preemptions += 1
        self.waiting.append(victim)
        preempted.append(victim)
        self.num_preemptions += 1
        logger.debug("preempted %s", victim)

    def preempt_all(self) -> int:
        """Every running sequence back to the queue (its model is being offloaded)."""
        victims = sorted(self.running, key=self.key, reverse=True)
        budget = StepBudget(self.max_num_batched_tokens)
        for victim in victims:
            self._preempt(victim, budget, {}, [])
        return len(victims)

    # -- integrity ---------------------------------------------------------------------------
    def check_invariants(self, out: SchedulerOutput | None = None) -> None:
        """Raise if block accounting or a budget is off: pool integrity, every held block
        referenced by exactly its holders, waiting sequences holding nothing, running ones no
        more than their tokens need (one spare at most), the sequence cap, the adapter cap
        and token budget kept, and each scheduled sequence holding exactly the blocks for its tokens."""
        kv, bs = self.kv, self.block_size
        kv.check_integrity()
        for seq in self.waiting:
            if kv.blocks_of(seq):
                raise AssertionError(f"{seq} waits while holding blocks")
        for seq in self.running:
            need = -(-seq.num_tokens // bs)
            if len(kv.blocks_of(seq)) > need + 1:
                raise AssertionError(f"{seq} holds {len(kv.blocks_of(seq))} blocks, needs {need}")
        if len(self.running) > self.max_num_seqs:
            raise AssertionError("more running sequences than max_num_seqs")
        if self.max_loras:
            adapters = {s.state.req.lora_id for s in self.running} - {0}
            if len(adapters) > self.max_loras:
                raise AssertionError(f"{len(adapters)} adapters running, max_loras {self.max_loras}")
        if out is None:
            return
        total = sum(n for _, n in out.scheduled)
        if total > self.max_num_batched_tokens or total != out.num_batched_tokens:
            raise AssertionError(f"step schedules {total} tokens, budget {self.max_num_batched_tokens}")
        for seq, n in out.scheduled:
            held = len(kv.blocks_of(seq))
            if seq.status is not SeqStatus.RUNNING or held != -(-(seq.num_computed_tokens + n) // bs):
                raise AssertionError(f"{seq}: {held} blocks for {seq.num_computed_tokens + n} tokens")
