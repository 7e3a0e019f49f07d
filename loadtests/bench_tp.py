"""`lockgate bench tp`: one rank against two (tensor parallelism, gloo on the CPU, NCCL on
CUDA) on the same machine in one run, on the small demo model and on one decoder layer of
Llama-2-7B's shape (random weights): output tokens per second, and the share of the steps'
forward time rank 0 spent inside collectives.

Each side runs in a fresh process of its own, the sides alternating, `repeats` times; the
fastest run of each counts. Both sides get the same cores: one rank takes them all, two
ranks half each. On a CPU two ranks are not expected to be faster (they split the same
cores and add an all-reduce per layer half); the figure is there so the next change to the
communication can be judged against it."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from lockgate.loadtests.bench_peer import layer7b_model_dir
from lockgate.loadtests.bench_throughput import _in_fresh_process, default_model_dir


@dataclass(frozen=True, slots=True)
class TpCase:
    """One model's workload: `num_requests` prompts of `prompt_len` tokens, each forced to
    `output_len` tokens."""

    name: str
    model_dir: str
    num_requests: int
    prompt_len: int
    output_len: int


def default_cases() -> list[TpCase]:
    return [TpCase("demo model (llama small)", str(default_model_dir()), 32, 128, 32),
            TpCase("7B-shaped layer (hidden 4096, MLP 11008, 32 heads)", str(layer7b_model_dir()), 8, 128, 16)]


def run_side(case: TpCase, size: int, seed: int) -> dict[str, Any]:
    """One side, in the process it is called in: the engine at tensor_parallel_size `size`
    started and warmed, then the workload timed."""
    from lockgate.engine import LLM, SamplingParams
    from lockgate.engine.config import ModelConfig

    vocab = ModelConfig.from_dir(case.model_dir).vocab_size
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(case.prompt_len)] for _ in range(case.num_requests)]
    llm = LLM(case.model_dir, tensor_parallel_size=size, dtype="float32", enable_prefix_caching=False)
    try:
        llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(max_tokens=2), use_progress_bar=False)
        core, runner = llm.engine, llm.engine.runner
        comm0, fwd0, steps0 = runner.collective_s, core.timings.forward, core.timings.num_steps
        params = SamplingParams(max_tokens=case.output_len, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
        elapsed = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tokens != case.num_requests * case.output_len:
            raise RuntimeError(f"tensor_parallel_size {size}: {tokens} tokens, not the forced lengths")
        steps = core.timings.num_steps - steps0
        forward = core.timings.forward - fwd0
        comm = runner.collective_s - comm0
        return {"size": size, "elapsed_s": elapsed, "output_tokens": tokens, "tok_s": tokens / elapsed,
                "steps": steps, "forward_s": forward, "collective_s": comm,
                "collective_share": comm / forward if forward else 0.0,
                "step_ms": 1000 * elapsed / max(1, steps), "first_tokens": [list(o.outputs[0].token_ids[:4])
                                                                           for o in outs[:2]]}
    finally:
        llm.engine.shutdown()


def bench_tp(cases: list[TpCase] | None = None, *, sizes: tuple[int, ...] = (1, 2), repeats: int = 3,
             seed: int = 0, fresh_process: bool = True, echo=print) -> dict[str, Any]:
    import torch

    cases = cases if cases is not None else default_cases()
    echo(f"tensor parallelism, N={' vs N='.join(map(str, sizes))}: device "
         f"{'cuda' if torch.cuda.is_available() else 'cpu'}, torch threads {torch.get_num_threads()} "
         f"(split among the ranks), fp32, best of {repeats} alternating runs, each in a fresh process")
    out: dict[str, Any] = {"cases": {}}
    for case in cases:
        best: dict[int, dict[str, Any]] = {}
        for rep in range(repeats):
            for size in sizes:
                run = _in_fresh_process(run_side, case, size, seed) if fresh_process else run_side(case, size, seed)
                echo(f"  {case.name[:28]:<28} run {rep + 1}/{repeats} N={size}: {run['tok_s']:9.1f} tok/s, "
                     f"collectives {100 * run['collective_share']:5.1f}% of the forward")
                if size not in best or run["elapsed_s"] < best[size]["elapsed_s"]:
                    best[size] = run
        out["cases"][case.name] = {"workload": {"requests": case.num_requests, "prompt_len": case.prompt_len,
                                                "output_len": case.output_len},
                                   "best": {str(s): r for s, r in best.items()},
                                   "ratio": best[sizes[-1]]["tok_s"] / best[sizes[0]]["tok_s"]}
    _report(out, sizes, echo)
    return out


def _report(out: dict[str, Any], sizes: tuple[int, ...], echo) -> None:
    echo("")
    echo(f"{'model':<52}{'N':>3}{'output tok/s':>14}{'ms/step':>9}{'steps':>7}{'in collectives':>16}")
    for name, case in out["cases"].items():
        for size in sizes:
            r = case["best"][str(size)]
            echo(f"{name:<52}{size:>3}{r['tok_s']:>14.1f}{r['step_ms']:>9.1f}{r['steps']:>7}"
                 f"{100 * r['collective_share']:>15.1f}%")
        echo(f"{'':<52}N={sizes[-1]} / N={sizes[0]}: {case['ratio']:.2f}x")
