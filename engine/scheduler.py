"""The step scheduler: which sequences run this step, how many tokens each, who is preempted.

One token budget (`max_num_batched_tokens`) and one sequence cap (`max_num_seqs`) per step.
Every running decode comes first, in policy order; then prefill chunks of running and
waiting sequences together, in policy order.

`priority` orders by service class; inside a class, by tenant fairness (virtual token
counters as in VTC, OSDI'24: the backlogged tenant with the least weighted service goes
next); inside a tenant, by the request's priority; then arrival. `fcfs` orders by arrival
alone. When blocks run out, the least urgent running sequence is preempted (blocks freed,
its cached prefix kept for its return, recomputed later, its place in line kept); a waiting
sequence may preempt running ones of a less urgent class, or, when its tenant holds no
slot of its class, the newest of the tenant holding the most (engine/preemption.py: a
floor on every tenant's latency). `reserved_kv_fraction`
keeps a share of the blocks out of reach of less urgent classes. With LoRA on, at most
`max_loras` adapters run at once, and adapters take turns (`_lora_admissible`).

How much prefill each class may add to a step is step sizing (engine/step_sizing.py): so an
arrival waits at most for one short step in flight, then gets a step of its own. After the
step ran, `update` advances the scheduled sequences' computed counts and registers their
newly full blocks in the prefix cache.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lockgate.engine.config import EngineConfig
from lockgate.engine.cost_model import StepCostModel, StepShape
from lockgate.engine.fairness import DECODE_COST, PREFILL_COST, Fairness, TenantStats
from lockgate.engine.kv_cache import KVBlock, KVCacheManager
from lockgate.engine.preemption import room_victim
from lockgate.engine.request import RequestState, SeqStatus, Sequence
from lockgate.engine.step_sizing import StepSizer

if TYPE_CHECKING:
    from lockgate.engine.spec.decode import SpecDecoder

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StepBudget:
    tokens_left: int
    num_tokens: int = 0

    def take(self, num_tokens: int) -> None:
        if not 0 < num_tokens <= self.tokens_left:
            raise ValueError(f"step budget: cannot take {num_tokens} tokens, {self.tokens_left} left")
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
    step_target_s: float | None = None   # its step-time target, when less urgent prefill or drafts were sized
    # speculative decoding: the draft tokens of each decode that carries some (it computes
    # its last token and these: 1 + len(drafts) tokens in `scheduled`)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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
        self.sizer = StepSizer(config, self.block_size)   # step sizing from the cost model
        self.tenant_stats: dict[tuple[int, str], TenantStats] = defaultdict(TenantStats)
        self._step_charges: dict[Sequence, list[tuple[int, bool]]] = {}
        self._admitting = True
        # LoRA: at most max_loras distinct adapters among running sequences; an adapter
        # whose requests are queued is admitted only once it is in host memory
        self.max_loras = config.max_loras if config.enable_lora else 0
        self.lora_ready: Callable[[int], bool] = lambda _aid: True
        # structured outputs: a waiting sequence starts once its grammar is compiled
        self.grammar_ready: Callable[[Sequence], bool] = lambda _seq: True
        self._running_loras: set[int] = set()
        self._lora_gate: int | None = None
        # set by a model pool when this model's turn is over: running work finishes, nothing
        # new starts (so switching away preempts, and later recomputes, nothing)
        self.admission_paused = False
        self.spec: SpecDecoder | None = None      # speculative decoding, set by the engine
        self._drafts: dict[Sequence, list[int]] = {}

    @property
    def cost(self) -> StepCostModel:
        """The step-cost model sizing relies on, fitted from every step."""
        return self.sizer.cost

    @cost.setter
    def cost(self, model: StepCostModel) -> None:
        self.sizer.cost = model

    def class_active(self, rank: int) -> bool:
        """Whether the class of rank `rank` has work (step sizing's `QueueView`)."""
        return bool(self.fair.active[rank])

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
        self.sizer.arrival(state.class_rank)
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

    def _take(self, seq: Sequence, num_tokens: int, budget: StepBudget,
              scheduled: dict[Sequence, int], decode: bool) -> None:
        scheduled[seq] = num_tokens
        budget.take(num_tokens)
        self.sizer.add(seq, num_tokens)
        self._charge(seq, num_tokens, decode=decode)

    def _charge(self, seq: Sequence, num_tokens: int, decode: bool, record: bool = True) -> None:
        """Count `num_tokens` of service to `seq`'s tenant (negative: a refund)."""
        st = self.stats_of(seq)
        if decode:
            st.decode_tokens += num_tokens
        else:
            st.prefill_tokens += num_tokens
            self.sizer.charge_prefill(seq.state.class_rank, num_tokens)
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
        self._drafts = {}
        self._admitting = True
        self.sizer.begin(self)
        if self.spec is not None:
            self.spec.begin(self.running, self.waiting, self.sizer, self.max_num_batched_tokens)
        self._running_loras = {s.state.req.lora_id for s in self.running} - {0}
        self._lora_gate = None
        self.running.sort(key=self.key)
        self._schedule_decodes(budget, scheduled, preempted)
        self._schedule_prefills(budget, scheduled, preempted)
        if self.sizer.background_prefill_step and self.sizer.background_tokens == 0:
            # the background prefill could not start (no slot, no blocks, admission paused):
            # the less urgent decodes run after all
            self.sizer.cancel_background_prefill_step()
            self._schedule_decodes(budget, scheduled, preempted)
        items = list(scheduled.items())  # insertion order: decodes, then prefill chunks
        sizer = self.sizer
        return SchedulerOutput(items, preempted, budget.num_tokens, sizer.shape, sizer.urgent_class,
                               sizer.target, self._drafts)

    def update(self, out: SchedulerOutput, accepted: dict[Sequence, int] | None = None) -> None:
        """After the step ran: each scheduled sequence computed its tokens (a decode with drafts its
        last and the `accepted[seq]` drafts: the rest's slots released); full blocks to the prefix cache."""
        for seq, num_new in out.scheduled:
            if accepted is not None and seq in accepted:
                seq.num_computed_tokens += 1 + accepted[seq]
                self.kv.truncate(seq, seq.num_computed_tokens)
            else:
                seq.num_computed_tokens += num_new
            self.kv.cache_full_blocks(seq)

    def _schedule_decodes(self, budget: StepBudget, scheduled: dict[Sequence, int],
                          preempted: list[Sequence]) -> None:
        after = sum(1 for s in self.running if s.is_decode and s not in scheduled)   # decodes to come
        for seq in list(self.running):
            if seq.status is not SeqStatus.RUNNING or not seq.is_decode or seq in scheduled:
                continue
            after -= 1
            if self.sizer.skips_decode(seq):
                continue
            if budget.tokens_left < 1:
                return
            # drafts with their blocks, never preempting, a token left for each decode to come
            drafts = self.spec.try_drafts(seq, budget.tokens_left - after, self.reserve_for(seq)) if self.spec else []
            if drafts:
                self._drafts[seq] = drafts
                self._take(seq, 1 + len(drafts), budget, scheduled, decode=True)
            elif self._allocate_or_preempt(seq, 1, budget, scheduled, preempted):
                self._take(seq, 1, budget, scheduled, decode=True)

    def _schedule_prefills(self, budget: StepBudget, scheduled: dict[Sequence, int],
                           preempted: list[Sequence]) -> None:
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

    def _prefill_one(self, seq: Sequence, budget: StepBudget, scheduled: dict[Sequence, int],
                     preempted: list[Sequence]) -> None:
        if seq.status is SeqStatus.RUNNING:
            # running prefills go on even once admission has stopped: they hold blocks
            # that an earlier waiting sequence may be waiting for
            if seq in scheduled or seq not in self.running:
                return
            num_new = min(seq.num_pending_tokens, self.sizer.room(seq, budget.tokens_left))
            if num_new < 1:
                return
            if self._allocate_or_preempt(seq, num_new, budget, scheduled, preempted):
                self._take(seq, num_new, budget, scheduled, decode=False)
        elif self._admitting and seq not in preempted and self.sizer.room(seq, budget.tokens_left) > 0:
            if self.admission_paused or not self._lora_admissible(seq) or not self.grammar_ready(seq):
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

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, budget: StepBudget,
                             scheduled: dict[Sequence, int], preempted: list[Sequence]) -> bool:
        """Blocks for a running sequence, preempting the least urgent running ones (possibly
        itself) until they fit. False when `seq` itself was preempted."""
        reserve = self.reserve_for(seq)
        while not self.kv.try_allocate(seq, num_new, reserve=reserve):
            victim = max(self.running, key=self.key)
            self._preempt(victim, budget, scheduled, preempted)
            if victim is seq:
                return False
        return True

    def _try_admit(self, seq: Sequence, budget: StepBudget, scheduled: dict[Sequence, int],
                   preempted: list[Sequence]) -> int | None:
        """Move a waiting sequence to running with a first chunk. Returns the chunk's token
        count, 0 to skip it this step (a sibling waiting for its leader), None to stop
        admitting anything further this step."""
        shared = self._shareable_blocks(seq)
        if shared is None:
            return 0
        while len(self.running) >= self.max_num_seqs:
            if not self._preempt_for(seq, budget, scheduled, preempted):
                return None
        num_cached = len(shared) * self.block_size
        num_new = seq.num_tokens - num_cached
        if not self.chunked_prefill and seq.num_output_tokens == 0 and num_new > budget.tokens_left:
            return None
        seq.num_computed_tokens = num_cached   # what the room is sized from
        num_new = min(num_new, self.sizer.room(seq, budget.tokens_left))
        if num_new < 1:
            seq.num_computed_tokens = 0
            return None
        reserve = self.reserve_for(seq)
        while not self.kv.try_allocate(seq, num_new, shared, reserve=reserve):
            if not self._preempt_for(seq, budget, scheduled, preempted):
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

    def _preempt_for(self, seq: Sequence, budget: StepBudget, scheduled: dict[Sequence, int],
                             preempted: list[Sequence]) -> bool:
        """Under the priority policy, preempt a running sequence to make room for waiting
        `seq`: one of a less urgent class, else by the tenant floor (engine/preemption.py).
        False if none may be."""
        victim = room_victim(self.running, seq, self.key) if self.policy == "priority" else None
        if victim is None:
            return False
        self._preempt(victim, budget, scheduled, preempted)
        return True

    def _preempt(self, victim: Sequence, budget: StepBudget, scheduled: dict[Sequence, int],
                 preempted: list[Sequence]) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        self._drafts.pop(victim, None)
        if victim in scheduled:
            self.sizer.add(victim, scheduled[victim], -1)
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
