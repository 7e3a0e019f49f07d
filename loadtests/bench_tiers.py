"""`lockgate bench priority --tiers`: the `priority` class above `online`, on the engine's
defaults but a small `max_num_seqs`.

Two runs, each a fresh process driving `EngineCore` in real time (as `bench_priority`):
1. priority alone: a Poisson trickle of class `priority` on an idle engine;
2. mixed: `online` requests kept outstanding at twice `max_num_seqs`, so every sequence
   slot is always taken by online work, and the same priority trickle arriving into it.

A priority arrival finds no free slot and preempts an online sequence (which returns to the
queue in its place and recomputes later). Targets: priority TTFT p99 of the mixed run at
most priority-alone p99 + 2 x the median step of the mixed run; every online request that
was preempted completes with output equal to HF transformers' greedy decoding.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from lockgate.loadtests.bench_priority import allowed_token_ids, poisson_arrivals, run_sides, warm_up
from lockgate.loadtests.bench_throughput import default_model_dir
from lockgate.loadtests.stats import percentile

MODES = ("alone", "mixed")


@dataclass(slots=True, frozen=True)
class TierSizes:
    duration_s: float = 20.0
    warmup_s: float = 5.0
    drain_s: float = 20.0
    priority_rate: float = 1.0
    priority_prompt: tuple[int, int] = (56, 72)
    priority_output: tuple[int, int] = (16, 32)
    max_num_seqs: int = 8
    online_prompt: tuple[int, int] = (64, 256)
    online_output: tuple[int, int] = (32, 96)
    seed: int = 0
    num_threads: int | None = None


def run_tiers_side(model_dir: str, mode: str, sizes: dict[str, Any]) -> dict[str, Any]:
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.engine_core import EngineCore
    from lockgate.engine.request import EngineRequest
    from lockgate.engine.sampling_params import SamplingParams

    s = TierSizes(**sizes)
    core = EngineCore(EngineConfig(model=model_dir, dtype="float32", max_num_seqs=s.max_num_seqs,
                                   seed=s.seed, num_threads=s.num_threads))
    allowed = allowed_token_ids(model_dir)
    warm_up(core, allowed)
    arrivals = poisson_arrivals(s.seed, s.priority_rate, s.duration_s, allowed, s.priority_prompt,
                                s.priority_output)
    on_rng = random.Random(s.seed + 1)
    online: list = []

    def add_online() -> None:
        n = on_rng.randint(*s.online_output)
        ids = on_rng.choices(allowed, k=on_rng.randint(*s.online_prompt))
        sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        online.append(core.add_request(EngineRequest(f"on-{len(online)}", ids, sp,
                                                     service_class="online", tenant="chat")))

    t0 = time.time()
    has_online = mode == "mixed"
    window_start = t0 + (s.warmup_s if has_online else 0.0)
    window_end = window_start + s.duration_s
    if has_online:
        for _ in range(2 * s.max_num_seqs):
            add_online()
    prio: list = []
    steps: list[float] = []
    next_p = 0
    while True:
        now = time.time()
        while next_p < len(arrivals) and window_start + arrivals[next_p][0] <= now:
            off, ids, n = arrivals[next_p]
            sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
            prio.append((window_start + off, core.add_request(EngineRequest(
                f"vip-{next_p}", ids, sp, service_class="priority", tenant="vip"))))
            next_p += 1
        if now >= window_end and next_p == len(arrivals) and all(
                st.finished_time is not None for _, st in prio):
            break
        if now >= window_end + s.drain_s:
            break
        if not core.has_unfinished:
            nxt = window_start + arrivals[next_p][0] if next_p < len(arrivals) else window_end
            time.sleep(max(0.0, min(nxt, window_end) - now))
            continue
        outs = core.step()
        end = time.time()
        if window_start <= now < window_end:
            steps.append(end - now)
        for o in outs:
            if o.request_id.startswith("on-") and now < window_end:
                add_online()
    t_stop = time.time()
    ttft = [(st.first_token_time or t_stop) - arr for arr, st in prio]
    preempted = _preempted_and_finished(online)
    stats = core.stats()
    for rid in list(core.requests):
        core.abort_request(rid)
    return {
        "mode": mode,
        "priority": {"requests": len(prio), "ttft_p50_s": percentile(ttft, 50),
                     "ttft_p99_s": percentile(ttft, 99), "ttft_max_s": max(ttft) if ttft else math.nan,
                     "censored": sum(1 for _, st in prio if st.first_token_time is None)},
        "steps": {"in_window": len(steps), "median_s": percentile(steps, 50),
                  "p90_s": percentile(steps, 90)},
        "preemptions": {c: row.preemptions for c, row in stats.classes.items()},
        "online_finished": sum(1 for st in online if st.finished_time is not None),
        "preempted_online": preempted,
    }


def _preempted_and_finished(online: list) -> list[dict[str, Any]]:
    """The online requests that were preempted and finished, each as its prompt, length and
    output: what the HF check decodes again."""
    return [{"prompt": list(st.req.prompt_token_ids), "max_tokens": st.req.sampling.max_tokens,
             "output": list(st.seqs[0].output_token_ids)}
            for st in online if st.finished_time is not None
            and sum(q.num_preemptions for q in st.seqs) > 0]


def hf_check(model_dir: str, cases: list[dict]) -> tuple[int, int]:
    """(equal, checked): HF greedy decoding of each preempted request against its output."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 local_files_only=True).eval()
    equal = 0
    with torch.inference_mode():
        for c in cases:
            ids = torch.tensor([c["prompt"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=c["max_tokens"], min_new_tokens=c["max_tokens"],
                                 pad_token_id=0)
            equal += out[0, ids.shape[1]:].tolist() == c["output"]
    return equal, len(cases)


def bench_tiers(model_dir: str | None = None, *, sizes: TierSizes | None = None,
                fresh_process: bool = True, echo=print) -> dict[str, Any]:
    model_dir = str(model_dir or default_model_dir())
    s = sizes or TierSizes()
    echo(f"tiers: priority trickle (Poisson {s.priority_rate:g}/s over {s.duration_s:g} s, prompts "
         f"{s.priority_prompt[0]}-{s.priority_prompt[1]}, outputs {s.priority_output[0]}-"
         f"{s.priority_output[1]} forced) alone, and beside {2 * s.max_num_seqs} online requests "
         f"kept outstanding (prompts {s.online_prompt[0]}-{s.online_prompt[1]}, outputs "
         f"{s.online_output[0]}-{s.online_output[1]}) that fill all max_num_seqs={s.max_num_seqs} "
         "slots; every other knob at the engine's default")
    results = run_sides({m: (run_tiers_side, (model_dir, m, asdict(s))) for m in MODES},
                        fresh_process, echo)
    alone, mixed = results["alone"], results["mixed"]
    bound = alone["priority"]["ttft_p99_s"] + 2 * mixed["steps"]["median_s"]
    p99 = mixed["priority"]["ttft_p99_s"]
    cases = mixed["preempted_online"]
    equal, checked = hf_check(model_dir, cases) if cases else (0, 0)
    targets = {"priority_ttft_within_two_steps": p99 <= bound,
               "preempted_online_equal_hf": checked > 0 and equal == checked}
    ok = {True: "holds", False: "DOES NOT HOLD"}
    echo("")
    echo(f"{'run':<10}{'TTFT p50':>10}{'TTFT p99':>10}{'step p50':>10}{'preempted':>11}")
    for m in MODES:
        r = results[m]
        echo(f"{m:<10}{r['priority']['ttft_p50_s'] * 1e3:>10.0f}{r['priority']['ttft_p99_s'] * 1e3:>10.0f}"
             f"{r['steps']['median_s'] * 1e3:>10.0f}{r['preemptions'].get('online', 0):>11}")
    echo(f"priority TTFT p99 {p99 * 1e3:.0f} ms vs alone p99 {alone['priority']['ttft_p99_s'] * 1e3:.0f} ms"
         f" + 2 x median step {mixed['steps']['median_s'] * 1e3:.0f} ms = {bound * 1e3:.0f} ms: "
         f"{ok[targets['priority_ttft_within_two_steps']]}")
    echo(f"online requests preempted by priority and finished: {checked}, output equal to HF greedy: "
         f"{equal}/{checked}: {ok[targets['preempted_online_equal_hf']]}")
    return {"results": results, "bound_s": bound, "hf_equal": equal, "hf_checked": checked,
            "targets": targets}
