"""`lockgate bench lora`: output tokens/s with many LoRA adapters mixed in the batch vs the
base model alone, on the same workload, in one run.

The workload: `num_requests` prompts (random non-special tokens, lengths drawn from
`prompt`), each forced to `output_len` tokens, all sent at once. The LoRA side gives request
i adapter i mod `num_adapters` (rank `rank`, all seven projections, written offline with
peft by `write_demo_adapter`) on an engine with `max_loras = num_adapters`, so every step
mixes every adapter; the base side runs the same prompts on an engine without LoRA.
Output tokens/s is the forced output tokens over the wall time from the first request in to
the last one out. Each side runs in a fresh process, `repeats` times, the sides alternating
(base, LoRA, base, LoRA, ...) so that a noisy neighbour on a shared machine hits both alike;
each side's best run counts. The adapters are read before the clock starts (the LoRA side
pays their slot loads inside the run).
"""

from __future__ import annotations

import json
import math
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lockgate.loadtests.bench_priority import allowed_token_ids, default_model_dir, drop_all, run_sides, warm_up

ALL_TARGETS = "q,k,v,o,gate,up,down"


@dataclass(slots=True, frozen=True)
class LoraSizes:
    num_requests: int = 64
    num_adapters: int = 8
    rank: int = 16
    targets: str = ALL_TARGETS
    prompt: tuple[int, int] = (64, 256)
    output_len: int = 64
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    seed: int = 0
    num_threads: int | None = None
    repeats: int = 2


def run_lora_side(model_dir: str, adapter_dirs: list[str] | None, sizes: dict[str, Any]) -> dict[str, Any]:
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.engine_core import EngineCore
    from lockgate.engine.lora import LoRARequest
    from lockgate.engine.request import EngineRequest
    from lockgate.engine.sampling_params import SamplingParams

    s = LoraSizes(**sizes)
    lora = adapter_dirs is not None
    core = EngineCore(EngineConfig(
        model=model_dir, max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
        seed=s.seed, num_threads=s.num_threads, enable_lora=lora,
        max_loras=max(1, s.num_adapters), max_lora_rank=max(1, s.rank),
    ))
    allowed = allowed_token_ids(model_dir)
    warm_up(core, allowed)
    requests = [LoRARequest(f"bench-{i}", i + 1, d) for i, d in enumerate(adapter_dirs or [])]
    for r in requests:
        core.add_lora(r)
    rng = random.Random(s.seed)
    prompts = [rng.choices(allowed, k=rng.randint(*s.prompt)) for _ in range(s.num_requests)]
    sp = SamplingParams(max_tokens=s.output_len, min_tokens=s.output_len, temperature=0.0, ignore_eos=True)
    core.timings.__init__()
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", p, sp, lora_request=requests[i % len(requests)] if lora else None))
    out_tokens = 0
    max_adapters_in_step = 0
    while core.has_unfinished:
        if lora:
            max_adapters_in_step = max(max_adapters_in_step, len(core.scheduler._running_loras))
        for out in core.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - t0
    timings = core.timings.as_dict()
    stats = core.stats()
    drop_all(core)
    return {
        "lora": lora,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "tok_per_s": out_tokens / elapsed,
        "num_steps": core.timings.num_steps,
        "timings_s": timings,
        "max_adapters_running": max_adapters_in_step,
        "lora_stats": stats.to_dict()["lora"],
    }


def bench_lora(
    model_dir: str | None = None,
    *,
    sizes: LoraSizes | None = None,
    json_out: str | None = None,
    fresh_process: bool = True,
    echo=print,
) -> dict[str, Any]:
    from lockgate.engine.lora_demo import write_demo_adapter

    model_dir = str(model_dir or default_model_dir())
    s = sizes or LoraSizes()
    if s.num_adapters < 1 or s.rank < 1:
        raise ValueError("num_adapters and rank must be >= 1")
    echo(f"model {model_dir}, seed {s.seed}")
    echo(f"{s.num_requests} requests sent at once, prompts of {s.prompt[0]}-{s.prompt[1]} tokens, "
         f"{s.output_len} output tokens each (forced)")
    echo(f"LoRA side: {s.num_adapters} adapters of rank {s.rank} on {s.targets}, request i runs adapter "
         f"i mod {s.num_adapters}, max_loras {s.num_adapters}; base side: the same requests, no LoRA")
    with tempfile.TemporaryDirectory(prefix="lockgate-bench-lora-") as tmp:
        t0 = time.perf_counter()
        dirs = [str(write_demo_adapter(model_dir, Path(tmp) / f"a{i}", rank=s.rank, targets=s.targets,
                                       seed=s.seed + i)) for i in range(s.num_adapters)]
        echo(f"  wrote {s.num_adapters} adapters in {time.perf_counter() - t0:.1f} s")
        runs: dict[str, list[dict[str, Any]]] = {"base": [], f"{s.num_adapters} adapters": []}
        for r in range(s.repeats):
            sides = {
                f"base #{r + 1}": (run_lora_side, (model_dir, None, asdict(s))),
                f"{s.num_adapters} adapters #{r + 1}": (run_lora_side, (model_dir, dirs, asdict(s))),
            }
            for name, res in run_sides(sides, fresh_process, echo).items():
                runs[name.rsplit(" #", 1)[0]].append(res)
        results = {name: max(rs, key=lambda x: x["tok_per_s"]) for name, rs in runs.items()}
    base, lora = results["base"], results[f"{s.num_adapters} adapters"]
    echo("")
    echo(f"{'':<14}{'out tok/s':>11}{'seconds':>9}{'steps':>7}{'forward s':>11}{'prepare s':>11}")
    for name, r in results.items():
        t = r["timings_s"]
        echo(f"{name:<14}{r['tok_per_s']:>11.1f}{r['elapsed_s']:>9.2f}{r['num_steps']:>7}"
             f"{t['forward']:>11.2f}{t['prepare']:>11.2f}")
    ratio = lora["tok_per_s"] / base["tok_per_s"] if base["tok_per_s"] > 0 else math.nan
    holds = ratio >= 0.7
    echo("")
    echo(f"adapters running at once, most: {lora['max_adapters_running']}")
    echo(f"output tok/s, {s.num_adapters} adapters / base: {ratio:.2f}x (target >= 0.7 on CPU): "
         f"{'holds' if holds else 'DOES NOT HOLD'}")
    report = {"ratio": ratio, "targets": {"lora_0_7x_of_base": holds},
              "all_runs_tok_per_s": {n: [x["tok_per_s"] for x in rs] for n, rs in runs.items()}}
    if json_out:
        Path(json_out).write_text(json.dumps({"sizes": asdict(s), "results": results, **report}, indent=2))
    return {"results": results, **report}
