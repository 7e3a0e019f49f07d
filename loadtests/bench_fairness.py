"""`lockgate bench fairness`: two tenants in one class, one sending 4x the other's load.

Each tenant keeps a fixed number of requests outstanding (the heavy one `heavy_ratio` times
the light one's), each replaced as soon as it finishes: a closed loop sized so both always
have requests waiting, i.e. both are backlogged in VTC's sense. The run is counted in engine
steps, not seconds, so its schedule is the same on any machine.

Service, as the scheduler charges it (VTC, OSDI'24, with w_p = 1 and w_q = 2): prefill tokens
computed x 1 + output tokens x 2, divided by the tenant's weight. Measured at every step
boundary while both tenants have waiting requests:

  * the weighted-service gap: over every interval [t1, t2] in which both stay backlogged,
    |W_heavy(t1, t2) - W_light(t1, t2)|, against VTC's bound 2 x max(w_p x L_input, w_q x M)
    (Theorem 4.4), L_input the longest prompt, M the most tokens the running batch can hold;
  * the gap of the scheduler's own virtual counters, against max(w_p x L_input, w_q x M);
  * Jain's index of the service each tenant got in consecutive windows of 50 steps.

The same run under `fcfs` is the baseline: requests in arrival order, the heavy tenant gets
about 4x the service.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lockgate.loadtests.bench_priority import allowed_token_ids, default_model_dir, drop_all, run_sides, warm_up

HEAVY, LIGHT = "heavy", "light"


@dataclass(slots=True, frozen=True)
class FairnessSizes:
    num_steps: int = 1500
    window_steps: int = 50
    light_outstanding: int = 16      # the heavy tenant keeps heavy_ratio x this many outstanding
    heavy_ratio: int = 4
    prompt: tuple[int, int] = (32, 256)
    output: tuple[int, int] = (32, 128)
    heavy_weight: float = 1.0
    light_weight: float = 1.0
    num_kv_blocks: int = 256
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    seed: int = 0
    num_threads: int | None = None
    max_seconds: float = 300.0       # a guard: stop early (and say so) past this


def vtc_bound(s: FairnessSizes, max_model_len: int) -> dict[str, float]:
    """VTC's U = max(w_p x L_input, w_q x M).

    M, in VTC "the maximum number of tokens that can be fitted in a running batch", is what
    lets a tenant's counter run ahead: once admitted, its requests decode every step whatever
    their tenant's counter, and what they hold (prompt and output so far) can never exceed the
    KV cache. Here that is min(KV blocks x block size, max_num_seqs x max_model_len): the
    cache is sized on purpose (`num_kv_blocks`) so that it is the binding limit, as the GPU's
    memory is in VTC's setting; the per-step token budget only slows how fast the gap moves.
    """
    from lockgate.engine.scheduler import DECODE_COST, PREFILL_COST

    l_input = s.prompt[1]
    m = min(s.num_kv_blocks * s.block_size, s.max_num_seqs * max_model_len)
    u = max(PREFILL_COST * l_input, DECODE_COST * m)
    return {"w_p": PREFILL_COST, "w_q": DECODE_COST, "L_input": l_input, "M": m, "U": u, "2U": 2 * u}


def jain(xs: list[float]) -> float:
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else 1.0


class _TwoTenants:
    """The heavy and the light tenant, each a closed loop: a request of theirs that finishes is
    replaced at once by their next one. `service` is a tenant's weighted service as the
    scheduler charged it; `snapshot` one row of the run's record."""

    def __init__(self, core, s: FairnessSizes, allowed: list[int]) -> None:
        self.core, self.s, self.allowed = core, s, allowed
        self.sched = core.scheduler
        self.online = core.class_rank["online"]
        self.weights = {HEAVY: s.heavy_weight, LIGHT: s.light_weight}
        self.rngs = {HEAVY: random.Random(s.seed * 2 + 1), LIGHT: random.Random(s.seed * 2 + 2)}
        self.counts = {HEAVY: 0, LIGHT: 0}
        self.finished = {HEAVY: 0, LIGHT: 0}

    def fill(self) -> None:
        # interleaved, so under fcfs neither tenant's whole load is simply ahead of the other's
        for _ in range(self.s.light_outstanding):
            for _ in range(self.s.heavy_ratio):
                self.add(HEAVY)
            self.add(LIGHT)

    def add(self, tenant: str) -> None:
        from lockgate.engine.request import EngineRequest
        from lockgate.engine.sampling_params import SamplingParams

        rng = self.rngs[tenant]
        ids = rng.choices(self.allowed, k=rng.randint(*self.s.prompt))
        n_out = rng.randint(*self.s.output)
        sp = SamplingParams(max_tokens=n_out, min_tokens=n_out, temperature=0.0, ignore_eos=True)
        self.core.add_request(EngineRequest(f"{tenant}-{self.counts[tenant]}", ids, sp, tenant=tenant,
                                            tenant_weight=self.weights[tenant]))
        self.counts[tenant] += 1

    def replace_finished(self, outs) -> None:
        for out in outs:
            tenant = out.request_id.split("-")[0]
            self.finished[tenant] += 1
            self.add(tenant)

    def service(self, tenant: str) -> float:
        ts = self.sched.tenant_stats.get((self.online, tenant))
        if ts is None:
            return 0.0
        return (ts.prefill_tokens * 1 + ts.decode_tokens * 2) / self.weights[tenant]

    def snapshot(self, t: float) -> tuple[float, float, float, float, bool, float]:
        """(W_heavy, W_light, counter_heavy, counter_light, both backlogged, t) now."""
        waiting = {HEAVY: 0, LIGHT: 0}
        for seq in self.sched.waiting:
            waiting[seq.state.req.tenant] = waiting.get(seq.state.req.tenant, 0) + 1
        fair = self.sched.fair
        return (self.service(HEAVY), self.service(LIGHT), fair.counter(self.online, HEAVY),
                fair.counter(self.online, LIGHT), waiting[HEAVY] > 0 and waiting[LIGHT] > 0, t)


def _run_steps(core, tenants: _TwoTenants, s: FairnessSizes) -> tuple[list[tuple], bool, float]:
    """`s.num_steps` steps (fewer past `s.max_seconds`), a snapshot at every step boundary.
    Returns the snapshots, whether the run stopped early, and its seconds."""
    rows: list[tuple[float, float, float, float, bool, float]] = []
    t0 = time.perf_counter()
    stopped_early = False
    for _ in range(s.num_steps):
        rows.append(tenants.snapshot(time.perf_counter() - t0))
        tenants.replace_finished(core.step())
        if time.perf_counter() - t0 > s.max_seconds:
            stopped_early = True
            break
    rows.append(tenants.snapshot(time.perf_counter() - t0))
    return rows, stopped_early, time.perf_counter() - t0


def _service_gaps(rows: list[tuple], window_steps: int) -> dict[str, Any]:
    """Over the segments of consecutive steps that start with both tenants backlogged: the
    largest weighted-service gap over any interval, the largest gap of the virtual counters,
    Jain's index of each whole window, and the gap's course (step, t, dW_heavy, dW_light, gap
    so far) for the report."""
    num_steps = len(rows) - 1
    gap_max, counter_gap_max, backlogged_steps = 0.0, 0.0, 0
    jains: list[float] = []
    series: list[tuple[int, float, float, float, float]] = []
    i = 0
    while i < num_steps:
        if not rows[i][4]:
            i += 1
            continue
        j = i
        while j < num_steps and rows[j][4]:
            j += 1
        # steps i..j-1 start backlogged: boundaries i..j
        seg = rows[i:j + 1]
        backlogged_steps += j - i
        d = [r[0] - r[1] for r in seg]
        lo = hi = d[0]
        for k, x in enumerate(d):
            lo, hi = min(lo, x), max(hi, x)
            series.append((i + k, seg[k][5], seg[k][0] - seg[0][0], seg[k][1] - seg[0][1], hi - lo))
        gap_max = max(gap_max, hi - lo)
        counter_gap_max = max(counter_gap_max, max(abs(r[2] - r[3]) for r in seg[:-1]))
        for w in range(i, j - window_steps + 1, window_steps):
            a, b = rows[w], rows[w + window_steps]
            jains.append(jain([b[0] - a[0], b[1] - a[1]]))
        i = j
    return {"backlogged_steps": backlogged_steps, "gap_max": gap_max, "counter_gap_max": counter_gap_max,
            "jain_windows": jains, "series": series}


def run_fairness_side(model_dir: str, policy: str, sizes: dict[str, Any]) -> dict[str, Any]:
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.engine_core import EngineCore

    s = FairnessSizes(**sizes)
    core = EngineCore(EngineConfig(
        model=model_dir, scheduling_policy=policy, num_kv_blocks=s.num_kv_blocks,
        block_size=s.block_size, max_num_batched_tokens=s.max_num_batched_tokens,
        max_num_seqs=s.max_num_seqs, seed=s.seed, num_threads=s.num_threads,
    ))
    allowed = allowed_token_ids(model_dir)
    warm_up(core, allowed, prompt_len=min(128, s.num_kv_blocks * s.block_size // 4))
    tenants = _TwoTenants(core, s, allowed)
    tenants.fill()
    rows, stopped_early, elapsed = _run_steps(core, tenants, s)
    num_preemptions = core.scheduler.num_preemptions
    drop_all(core)
    gaps = _service_gaps(rows, s.window_steps)
    jains = gaps["jain_windows"]
    total_h, total_l = rows[-1][0] - rows[0][0], rows[-1][1] - rows[0][1]
    return {
        "policy": policy,
        "num_steps": len(rows) - 1,
        "stopped_early": stopped_early,
        "elapsed_s": elapsed,
        "backlogged_steps": gaps["backlogged_steps"],
        "service": {HEAVY: total_h, LIGHT: total_l},
        "heavy_share": total_h / (total_h + total_l) if total_h + total_l else math.nan,
        "finished": tenants.finished,
        "gap_max": gaps["gap_max"],
        "counter_gap_max": gaps["counter_gap_max"],
        "jain_windows": jains,
        "jain_min": min(jains) if jains else math.nan,
        "jain_mean": statistics.fmean(jains) if jains else math.nan,
        "series": gaps["series"],
        "num_preemptions": num_preemptions,
        "max_model_len": core.max_model_len,
    }


def bench_fairness(
    model_dir: str | None = None,
    *,
    sizes: FairnessSizes | None = None,
    json_out: str | None = None,
    fresh_process: bool = True,
    echo=print,
) -> dict[str, Any]:
    model_dir = str(model_dir or default_model_dir())
    s = sizes or FairnessSizes()
    echo(f"model {model_dir}, seed {s.seed}")
    echo(f"two tenants, class online: {HEAVY} keeps {s.heavy_ratio * s.light_outstanding} requests "
         f"outstanding, {LIGHT} {s.light_outstanding} (weights {s.heavy_weight:g} / {s.light_weight:g}); "
         f"prompts {s.prompt[0]}-{s.prompt[1]} tokens, outputs {s.output[0]}-{s.output[1]} (forced); "
         f"{s.num_steps} steps, windows of {s.window_steps}")
    echo(f"engine: {s.num_kv_blocks} KV blocks of {s.block_size} = {s.num_kv_blocks * s.block_size} "
         f"tokens, max_num_batched_tokens {s.max_num_batched_tokens}, max_num_seqs {s.max_num_seqs}")
    sides = {p: (run_fairness_side, (model_dir, p, asdict(s))) for p in ("fcfs", "priority")}
    results = run_sides(sides, fresh_process, echo)
    report = _report(results, s, echo)
    if json_out:
        slim = {k: {kk: vv for kk, vv in v.items() if kk != "series"} for k, v in results.items()}
        Path(json_out).write_text(json.dumps({"sizes": asdict(s), "results": slim, **report}, indent=2))
    return {"results": results, **report}


def _report(results: dict[str, Any], s: FairnessSizes, echo) -> dict[str, Any]:
    bound = vtc_bound(s, results["priority"]["max_model_len"])
    echo("")
    echo(f"VTC bound: U = max(w_p x L_input, w_q x M) = max({bound['w_p']} x {bound['L_input']}, "
         f"{bound['w_q']} x {bound['M']}) = {bound['U']:.0f}; service-gap bound 2U = {bound['2U']:.0f}")
    for policy in ("priority", "fcfs"):
        r = results[policy]
        echo("")
        echo(f"{policy}: weighted service while both backlogged (W since the backlog began; gap = "
             f"largest |dW_{HEAVY} - dW_{LIGHT}| over any interval so far)")
        echo(f"  {'step':>6}{'s':>8}{'W ' + HEAVY:>12}{'W ' + LIGHT:>12}{'gap':>10}{'gap / 2U':>10}")
        series = r["series"]
        every = max(1, len(series) // 12)
        for k, (step, t, wh, wl, gap) in enumerate(series):
            if k % every == 0 or k == len(series) - 1:
                echo(f"  {step:>6}{t:>8.1f}{wh:>12.0f}{wl:>12.0f}{gap:>10.0f}{gap / bound['2U']:>10.2f}")
    echo("")
    echo(f"{'policy':<10}{'steps':>7}{'backlogged':>11}{HEAVY + ' share':>12}{'max gap':>10}"
         f"{'<= 2U':>7}{'counter gap':>12}{'<= U':>6}{'Jain min':>10}{'Jain mean':>10}{'windows':>8}")
    report: dict[str, Any] = {"bound": bound}
    for policy in ("fcfs", "priority"):
        r = results[policy]
        held = r["gap_max"] <= bound["2U"]
        cheld = r["counter_gap_max"] <= bound["U"]
        early = " (stopped early)" if r["stopped_early"] else ""
        echo(f"{policy:<10}{r['num_steps']:>7}{r['backlogged_steps']:>11}{r['heavy_share']:>12.2f}"
             f"{r['gap_max']:>10.0f}{'yes' if held else 'NO':>7}{r['counter_gap_max']:>12.0f}"
             f"{'yes' if cheld else 'NO':>6}{r['jain_min']:>10.3f}{r['jain_mean']:>10.3f}"
             f"{len(r['jain_windows']):>8}{early}")
        report[policy] = {"gap_max": r["gap_max"], "bound_holds": held, "counter_gap_max": r["counter_gap_max"],
                          "jain_min": r["jain_min"], "jain_mean": r["jain_mean"],
                          "heavy_share": r["heavy_share"]}
    p = results["priority"]
    targets = {"bound_holds": p["gap_max"] <= bound["2U"],
               "jain_at_least_0.95": bool(p["jain_windows"]) and p["jain_min"] >= 0.95}
    ok = {True: "holds", False: "DOES NOT HOLD"}
    echo("")
    echo(f"priority: service gap {p['gap_max']:.0f} <= 2U {bound['2U']:.0f}: {ok[targets['bound_holds']]}")
    echo(f"priority: Jain's index over {len(p['jain_windows'])} windows of {s.window_steps} steps, "
         f"min {p['jain_min']:.3f} (mean {p['jain_mean']:.3f}) >= 0.95: {ok[targets['jain_at_least_0.95']]}")
    f = results["fcfs"]
    echo(f"fcfs baseline: {HEAVY} share {f['heavy_share']:.2f}, gap {f['gap_max']:.0f}, "
         f"Jain min {f['jain_min']:.3f}")
    report["targets"] = targets
    return report
