"""What an engine reports about itself: `EngineStats` and its parts, plain dataclasses read
by attribute. `to_dict()` gives the nested JSON-ready form for an HTTP edge."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class QueueStats:
    """One service class's sequences and the service they got."""

    waiting: int = 0
    running: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0     # computed (uncached) prompt tokens, recomputation included
    decode_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens served from the prefix cache at admission


@dataclass(slots=True)
class TenantClassStats(QueueStats):
    """One tenant's share of a class, with its fairness counter and weight."""

    counter: float = 0.0
    weight: float = 1.0


@dataclass(slots=True)
class KVStats:
    total: int = 0
    used: int = 0
    free: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0     # in tokens, from either tier
    # the host-memory tier (engine/kv_cache/host_tier.py); all 0 while it is off. Hits and
    # queries in tokens (looked up past the device's hits), the rest in blocks
    host_total: int = 0
    host_held: int = 0
    host_queries: int = 0
    host_hits: int = 0
    host_copy_ins: int = 0
    host_stores: int = 0          # blocks the device evicted, copied to the host
    host_evictions: int = 0
    device_evictions: int = 0     # cached blocks the device cache evicted

    @property
    def device_hits(self) -> int:
        """Prefix-cache hits (tokens) the device cache served itself (`prefix_cache_hits` is both tiers')."""
        return max(0, self.prefix_cache_hits - self.host_hits)


@dataclass(slots=True)
class CostModelStats:
    """The step-cost model's fit: seconds per unit of each feature, and the median relative
    error of its recent predictions (each made before its step)."""

    samples: int
    ready: bool
    coefficients: dict[str, float] | None
    prediction_error_median: float | None
    predictions: int
    device: str = ""
    # each class's step-time target from its `slo` (None: sized from the step's decodes), and
    # the latest step's: its urgent class and the target its less urgent prefill was sized to
    step_targets: dict[str, float | None] = field(default_factory=dict)
    last_urgent_class: str | None = None
    last_step_target_s: float | None = None


@dataclass(slots=True)
class LoRAStats:
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    slot_bytes: int
    in_slots: dict[str, int]          # adapter name -> device slot
    in_cpu: list[str]                 # adapters in host memory, least recently used first
    requests: dict[str, int]          # adapter name -> requests using it
    slot_loads: int
    disk_loads: int


@dataclass(slots=True)
class QueueBounds:
    requests: int | None     # None: no count bound (tokens bound the queue)
    tokens: int
    per_class: int | None


@dataclass(slots=True)
class OverloadStats:
    """The bounded queue (engine/admission.py): queued per class, its bounds, and the
    requests refused and shed, per class and tenant."""

    queued: dict[str, int]
    queued_tokens: int
    bounds: QueueBounds
    refused: dict[str, dict[str, int]]
    shed: dict[str, dict[str, int]]
    # seconds the queued tokens take at full steps, by the step-cost model (None until it is
    # fitted): what the gateway refuses background work on
    drain_s: float | None = None


@dataclass(slots=True)
class PooledModelStats:
    """One model of a pool: residency, footprint, queue and switching counters."""

    resident: bool
    memory_bytes: int
    waiting: int
    running: int
    loads: int = 0
    offloads: int = 0
    load_s: float = 0.0
    offload_s: float = 0.0
    turns: int = 0
    steps: int = 0
    last_run: float = 0.0
    lora: LoRAStats | None = None


@dataclass(slots=True)
class PoolStats:
    """The pool several models share: its memory budget, switches, and each model."""

    memory: dict[str, int]
    switches: int
    switch_s: float
    current_model: str | None
    models: dict[str, PooledModelStats]


@dataclass(slots=True)
class WorkerPoolStats:
    """A Ray pool's workers as the gateway replica sees them: each worker's latest report
    (`down`, `restarts`, its models, queue and KV use) and the placement (which workers serve
    which model, and the placement's recent decisions with their reasons)."""

    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    assigned: dict[str, list[str]] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class RankMemory:
    """One tensor-parallel rank: its process, device and what its memory holds."""

    rank: int
    device: str
    pid: int
    weights_bytes: int
    kv_cache_bytes: int


@dataclass(slots=True)
class ParallelStats:
    """A model split over ranks: its communication (rank 0's seconds inside collectives, in
    all and in the latest step, against the forward's seconds), each rank's memory, and the
    rank group's rebuilds after a rank failed (the latest's seconds from failure to serving)."""

    tensor_parallel_size: int
    backend: str
    collective_s: float
    num_collectives: int
    forward_s: float
    last_step_collective_s: float
    ranks: list[RankMemory]
    rank_failures: int = 0
    last_recovery_s: float | None = None


@dataclass(slots=True)
class SpecClassStats:
    """Speculative decoding in one service class: drafts verified (rows that carried draft
    tokens), their tokens, the tokens kept, kept tokens by draft position (position 0: the
    first draft token; each count the rows that kept at least that many), and the switch:
    whether this class drafts now, its running acceptance (kept per draft token)."""

    enabled: bool = True
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    acceptance_rate: float | None = None      # num_accepted_tokens / num_draft_tokens
    running_acceptance: float | None = None   # what the switch decides on (recent rows weigh most)


@dataclass(slots=True)
class ThreadStats:
    """The intra-op threads (engine/threads.py): now, the width it returns to, the cores the
    rest of the machine used over the last window, and how often the width changed."""

    threads: int
    max_threads: int
    others_cores: float
    changes: int


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding (`EngineConfig.speculative_config`): the settings, the counters
    summed over classes (vLLM's `spec_decode_*` metrics), and each class's."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    auto_disable: bool
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    classes: dict[str, SpecClassStats] = field(default_factory=dict)


@dataclass(slots=True)
class EngineStats:
    """One model's engine (or, for a pool, the totals over its models)."""

    classes: dict[str, QueueStats] = field(default_factory=dict)
    tenants: dict[str, dict[str, TenantClassStats]] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)            # sequences, per class
    waiting: dict[str, int] = field(default_factory=dict)            # sequences, per class
    waiting_requests: dict[str, int] = field(default_factory=dict)   # requests none of whose samples runs
    running_by_tenant: dict[str, int] = field(default_factory=dict)
    waiting_by_tenant: dict[str, int] = field(default_factory=dict)
    num_requests: int = 0
    num_preemptions: int = 0
    num_generated_tokens: int = 0
    num_steps: int = 0
    kv: KVStats = field(default_factory=KVStats)
    memory: dict[str, int] = field(default_factory=dict)             # bytes by part ("weights_bytes"...)
    cost_model: CostModelStats | None = None     # a pool's totals: None, each model has its own
    lora: LoRAStats | None = None
    overload: OverloadStats | None = None        # AsyncEngine's bounded queue
    pool: PoolStats | None = None                # the pool the model is in
    residency: PooledModelStats | None = None    # a pooled model's own row in `pool`
    by_model: dict[str, EngineStats] = field(default_factory=dict)   # a pool's: each model's
    workers: WorkerPoolStats | None = None       # served by a Ray pool: its workers and placement
    parallel: ParallelStats | None = None        # tensor parallelism (None: one rank)
    by_worker: dict[str, EngineStats] = field(default_factory=dict)  # a Ray pool's: each worker's own
    spec: SpecStats | None = None                # speculative decoding (None: off)
    threads: ThreadStats | None = None           # adaptive intra-op threads (None: fixed)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summed_stats(parts: Iterable[EngineStats]) -> EngineStats:
    """Several engines' counts summed: a pool's models, or one model's pool workers.
    Fairness counters and weights are an engine's own, so their sum means little: they are
    kept from the first. Memory, cost model and adapters are per engine: left out."""
    out = EngineStats()
    for s in parts:
        for cls, q in s.classes.items():
            _add_counts(out.classes.setdefault(cls, QueueStats()), q)
        for tenant, by_class in s.tenants.items():
            mine = out.tenants.setdefault(tenant, {})
            for cls, row in by_class.items():
                if cls in mine:
                    _add_counts(mine[cls], row, keep=("counter", "weight"))
                else:
                    mine[cls] = dataclasses.replace(row)
        for name in ("running", "waiting", "waiting_requests", "running_by_tenant", "waiting_by_tenant"):
            into = getattr(out, name)
            for k, v in getattr(s, name).items():
                into[k] = into.get(k, 0) + v
        out.num_requests += s.num_requests
        out.num_preemptions += s.num_preemptions
        out.num_generated_tokens += s.num_generated_tokens
        out.num_steps += s.num_steps
        _add_counts(out.kv, s.kv)
        if s.spec is not None:
            out.spec = _add_spec(out.spec, s.spec)
    return out


def _add_spec(into: SpecStats | None, other: SpecStats) -> SpecStats:
    """Speculation counters summed (per class too); a class drafts if it does anywhere, its
    rates recomputed from the sums (the running one is an engine's own: the first's)."""
    if into is None:
        return dataclasses.replace(other, accepted_per_pos=list(other.accepted_per_pos),
                                   classes={c: dataclasses.replace(r, accepted_per_pos=list(r.accepted_per_pos))
                                            for c, r in other.classes.items()})
    pairs: list[tuple[SpecStats | SpecClassStats, SpecStats | SpecClassStats]] = [(into, other)]
    for cls, row in other.classes.items():
        mine = into.classes.setdefault(cls, SpecClassStats(accepted_per_pos=[0] * len(row.accepted_per_pos)))
        mine.enabled = mine.enabled or row.enabled
        pairs.append((mine, row))
    for a, b in pairs:
        a.num_drafts += b.num_drafts
        a.num_draft_tokens += b.num_draft_tokens
        a.num_accepted_tokens += b.num_accepted_tokens
        width = max(len(a.accepted_per_pos), len(b.accepted_per_pos))
        a.accepted_per_pos = [x + y for x, y in zip(a.accepted_per_pos + [0] * (width - len(a.accepted_per_pos)),
                                                    b.accepted_per_pos + [0] * (width - len(b.accepted_per_pos)),
                                                    strict=True)]
    for row in into.classes.values():
        row.acceptance_rate = row.num_accepted_tokens / row.num_draft_tokens if row.num_draft_tokens else None
    return into


def summed_parallel(parts: Iterable[ParallelStats | None]) -> ParallelStats | None:
    """Several models' rank groups on one budget (each model has its own): seconds, counts
    and failures summed, every group's ranks listed; the latest recovery the slowest's."""
    got = [p for p in parts if p is not None]
    if not got:
        return None
    recoveries = [p.last_recovery_s for p in got if p.last_recovery_s is not None]
    return ParallelStats(
        got[0].tensor_parallel_size, got[0].backend, sum(p.collective_s for p in got),
        sum(p.num_collectives for p in got), sum(p.forward_s for p in got),
        max(p.last_step_collective_s for p in got), [r for p in got for r in p.ranks],
        sum(p.rank_failures for p in got), max(recoveries) if recoveries else None)


def _add_counts(into: object, other: object, keep: tuple[str, ...] = ()) -> None:
    """Add `other`'s numeric fields into `into` (a dataclass of the same type), but `keep`."""
    for f in dataclasses.fields(other):     # type: ignore[arg-type]
        if f.name not in keep:
            setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))
