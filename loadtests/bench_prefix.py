"""`lockgate bench prefix`: requests of one tenant sharing a long system prompt, prefix
caching on vs off.

Each request is the shared prefix (random non-special token ids, `prefix_len` tokens) plus
a short suffix of its own, and asks for a few forced output tokens. The first request runs
alone to its end; then the other `num_requests - 1` are sent together (all added before the
next step; `--sequential`: one after another, each once the previous has finished). TTFT runs
from when a request is sent to its first token; p50 is over those sent after the first.
Prefill tokens computed are the scheduler's per-class count of prompt tokens actually
computed (prefix-cache hits excluded), for the requests after the first.

Each side is a fresh process. Sending them together, caching off queues ~31 full prompts
(tens of steps of prefill) while caching on computes only the suffixes in about one step.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lockgate.loadtests.bench_priority import allowed_token_ids, default_model_dir, drop_all, run_sides, warm_up
from lockgate.loadtests.stats import percentile


@dataclass(slots=True, frozen=True)
class PrefixSizes:
    num_requests: int = 32
    prefix_len: int = 1024
    suffix: tuple[int, int] = (16, 32)
    output_len: int = 8
    sequential: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    block_size: int = 16
    seed: int = 0
    num_threads: int | None = None


def run_prefix_side(model_dir: str, caching: bool, sizes: dict[str, Any]) -> dict[str, Any]:
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.engine_core import EngineCore
    from lockgate.engine.request import EngineRequest
    from lockgate.engine.sampling_params import SamplingParams

    s = PrefixSizes(**sizes)
    core = EngineCore(EngineConfig(
        model=model_dir, enable_prefix_caching=caching, block_size=s.block_size,
        max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
        seed=s.seed, num_threads=s.num_threads,
    ))
    if s.prefix_len + s.suffix[1] + s.output_len > core.max_model_len:
        raise ValueError(f"prefix {s.prefix_len} + suffix {s.suffix[1]} + output {s.output_len} "
                         f"exceeds max_model_len {core.max_model_len}")
    allowed = allowed_token_ids(model_dir)
    warm_up(core, allowed)   # another tenant: nothing it caches can serve the workload
    rng = random.Random(s.seed)
    prefix = rng.choices(allowed, k=s.prefix_len)
    prompts = [prefix + rng.choices(allowed, k=rng.randint(*s.suffix)) for _ in range(s.num_requests)]
    sp = SamplingParams(max_tokens=s.output_len, min_tokens=s.output_len, temperature=0.0,
                        ignore_eos=True)
    tenant = "acme"

    def prefill_tokens() -> int:
        ts = core.scheduler.tenant_stats.get((core.class_rank["online"], tenant))
        return ts.prefill_tokens if ts else 0

    def send(i: int):
        return time.time(), core.add_request(EngineRequest(f"p{i}", prompts[i], sp, tenant=tenant))

    def run_until_done() -> None:
        while core.has_unfinished:
            core.step()

    sent0, st0 = send(0)
    run_until_done()
    first = {"ttft_s": st0.first_token_time - sent0, "prefill_tokens": prefill_tokens(),
             "cached_tokens": st0.num_cached_tokens}
    before = prefill_tokens()
    sent: list[tuple[float, Any]] = []
    t0 = time.perf_counter()
    if s.sequential:
        for i in range(1, s.num_requests):
            sent.append(send(i))
            run_until_done()
    else:
        sent = [send(i) for i in range(1, s.num_requests)]
        run_until_done()
    elapsed = time.perf_counter() - t0
    computed = prefill_tokens() - before
    ttft = [st.first_token_time - t for t, st in sent]
    prompt_tokens = sum(len(p) for p in prompts[1:])
    steps = core.timings.num_steps
    drop_all(core)
    return {
        "caching": caching,
        "first": first,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else math.nan,
        "prefill_tokens": computed,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(st.num_cached_tokens for _, st in sent),
        "elapsed_s": elapsed,
        "num_steps": steps,
        "max_model_len": core.max_model_len,
    }


def bench_prefix(
    model_dir: str | None = None,
    *,
    sizes: PrefixSizes | None = None,
    json_out: str | None = None,
    fresh_process: bool = True,
    echo=print,
) -> dict[str, Any]:
    model_dir = str(model_dir or default_model_dir())
    s = sizes or PrefixSizes()
    from lockgate.engine.config import ModelConfig

    max_len = ModelConfig.from_dir(model_dir).max_position_embeddings
    if s.prefix_len + s.suffix[1] + s.output_len > max_len:
        raise ValueError(f"prefix_len {s.prefix_len} + suffix + output do not fit the model's "
                         f"{max_len} positions: use a shorter prefix")
    how = "one after another" if s.sequential else "together"
    echo(f"model {model_dir} (max_position_embeddings {max_len}), seed {s.seed}")
    echo(f"{s.num_requests} requests of one tenant: a shared {s.prefix_len}-token prefix + a "
         f"{s.suffix[0]}-{s.suffix[1]}-token suffix of their own, {s.output_len} output tokens (forced); "
         f"the first run alone to its end, then the other {s.num_requests - 1} sent {how}")
    echo(f"engine: max_num_batched_tokens {s.max_num_batched_tokens}, block size {s.block_size}")
    sides = {f"caching {'on' if c else 'off'}": (run_prefix_side, (model_dir, c, asdict(s)))
             for c in (True, False)}
    results = run_sides(sides, fresh_process, echo)
    on, off = results["caching on"], results["caching off"]
    echo("")
    echo(f"{'':<12}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'prefill tokens':>16}{'cached':>9}"
         f"{'of prompt':>11}{'1st TTFT ms':>12}{'steps':>7}")
    for name, r in results.items():
        echo(f"{name:<12}{r['ttft_p50_s'] * 1000:>12.1f}{r['ttft_p99_s'] * 1000:>12.1f}"
             f"{r['prefill_tokens']:>16}{r['cached_tokens']:>9}{r['prompt_tokens']:>11}"
             f"{r['first']['ttft_s'] * 1000:>12.1f}{r['num_steps']:>7}")
    echo(f"(over the {s.num_requests - 1} requests after the first; steps include the first's)")
    speedup = off["ttft_p50_s"] / on["ttft_p50_s"] if on["ttft_p50_s"] > 0 else math.inf
    fewer = 1 - on["prefill_tokens"] / off["prefill_tokens"] if off["prefill_tokens"] else math.nan
    total_on = on["prefill_tokens"] + on["first"]["prefill_tokens"]
    total_off = off["prefill_tokens"] + off["first"]["prefill_tokens"]
    targets = {"ttft_p50_5x_lower": speedup >= 5, "prefill_90pct_fewer": fewer >= 0.9}
    ok = {True: "holds", False: "DOES NOT HOLD"}
    echo("")
    echo(f"TTFT p50 off / on            : {speedup:.1f}x (target >= 5): {ok[targets['ttft_p50_5x_lower']]}")
    echo(f"prefill tokens computed, on vs off: {fewer * 100:.1f}% fewer (target >= 90%): "
         f"{ok[targets['prefill_90pct_fewer']]}; all {s.num_requests} requests: "
         f"{total_on} vs {total_off} ({(1 - total_on / total_off) * 100:.1f}% fewer)")
    report = {"ttft_p50_speedup": speedup, "prefill_fewer": fewer, "targets": targets}
    if json_out:
        Path(json_out).write_text(json.dumps({"sizes": asdict(s), "results": results, **report}, indent=2))
    return {"results": results, **report}
