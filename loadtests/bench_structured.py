"""`lockgate bench structured`: output tokens/s of a batch with half its requests held to a
JSON schema vs the same batch with none constrained, in one run.

The workload: `num_requests` prompts (random non-special tokens, lengths drawn from
`prompt`), all sent at once, each forced to `output_len` tokens. On the constrained side
every other request carries `RECORDS`, a JSON schema of a list of at least 50 small objects
(integer range, bounded string, enum: every parser path of a realistic schema), which no
output can complete within `output_len` tokens, so both sides emit exactly the same number
of tokens and only the grammar's cost differs (mask per constrained row and step, matcher
advanced by each token). The grammar is compiled before the clock starts (as the gateway
does before a request reaches the engine). Each side runs in a fresh process, `repeats`
times, the sides alternating so a noisy neighbour hits both alike; each side's best run
counts. Greedy decoding on both sides.
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

RECORDS = {
    "type": "array", "minItems": 50, "maxItems": 60,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "tag"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                             "name": {"type": "string", "maxLength": 12},
                             "tag": {"enum": ["alpha", "beta", "gamma"]}}},
}


@dataclass(slots=True, frozen=True)
class StructuredSizes:
    num_requests: int = 64
    prompt: tuple[int, int] = (32, 128)
    output_len: int = 64
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    seed: int = 0
    num_threads: int | None = None
    repeats: int = 3


def run_structured_side(model_dir: str, constrained: bool, sizes: dict[str, Any]) -> dict[str, Any]:
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.engine_core import EngineCore
    from lockgate.engine.request import EngineRequest
    from lockgate.engine.sampling_params import SamplingParams, StructuredOutputsParams

    s = StructuredSizes(**sizes)
    core = EngineCore(EngineConfig(model=model_dir, max_num_batched_tokens=s.max_num_batched_tokens,
                                   max_num_seqs=s.max_num_seqs, seed=s.seed, num_threads=s.num_threads))
    allowed = allowed_token_ids(model_dir)
    warm_up(core, allowed)
    spec = StructuredOutputsParams(json=RECORDS)
    core.grammars.compiler.compile(spec).result()       # compiled before the clock starts
    rng = random.Random(s.seed)
    prompts = [rng.choices(allowed, k=rng.randint(*s.prompt)) for _ in range(s.num_requests)]
    free = SamplingParams(max_tokens=s.output_len, min_tokens=s.output_len, temperature=0.0, ignore_eos=True)
    held = SamplingParams(max_tokens=s.output_len, temperature=0.0, structured_outputs=spec)
    core.timings.__init__()
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", p, held if constrained and i % 2 == 0 else free))
    out_tokens = 0
    texts = []
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
                texts.append(out.outputs[0].text)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    timings = core.timings.as_dict()
    drop_all(core)
    return {
        "constrained": constrained,
        "output_tokens": out_tokens,
        "elapsed_s": elapsed,
        "tok_per_s": out_tokens / elapsed,
        "cpu_s": cpu,
        "tok_per_cpu_s": out_tokens / cpu,
        "num_steps": core.timings.num_steps,
        "timings_s": timings,
        "sample_text": next((t for t in texts if t.startswith("[")), texts[0] if texts else ""),
    }


def bench_structured(
    model_dir: str | None = None,
    *,
    sizes: StructuredSizes | None = None,
    json_out: str | None = None,
    fresh_process: bool = True,
    echo=print,
) -> dict[str, Any]:
    model_dir = str(model_dir or default_model_dir())
    s = sizes or StructuredSizes()
    echo(f"model {model_dir}, seed {s.seed}")
    echo(f"{s.num_requests} requests sent at once, prompts of {s.prompt[0]}-{s.prompt[1]} tokens, "
         f"{s.output_len} output tokens each (forced), greedy")
    echo("constrained side: every other request held to a JSON schema (a list of >= 50 records: "
         "integer range, bounded string, enum); free side: the same requests, none constrained")
    runs: dict[str, list[dict[str, Any]]] = {"free": [], "half constrained": []}
    for r in range(s.repeats):
        sides = {
            f"free #{r + 1}": (run_structured_side, (model_dir, False, asdict(s))),
            f"half constrained #{r + 1}": (run_structured_side, (model_dir, True, asdict(s))),
        }
        for name, res in run_sides(sides, fresh_process, echo).items():
            runs[name.rsplit(" #", 1)[0]].append(res)
    results = {name: max(rs, key=lambda x: x["tok_per_s"]) for name, rs in runs.items()}
    free, held = results["free"], results["half constrained"]
    if free["output_tokens"] != held["output_tokens"]:
        raise RuntimeError(f"the sides emitted different token counts: {free['output_tokens']} vs "
                           f"{held['output_tokens']}")
    echo("")
    echo(f"{'':<18}{'out tok/s':>11}{'tok/CPU-s':>11}{'seconds':>9}{'steps':>7}{'forward s':>11}"
         f"{'sample s':>10}{'detok s':>9}")
    for name, r in results.items():
        t = r["timings_s"]
        echo(f"{name:<18}{r['tok_per_s']:>11.1f}{r['tok_per_cpu_s']:>11.1f}{r['elapsed_s']:>9.2f}{r['num_steps']:>7}"
             f"{t['forward']:>11.2f}{t['sample']:>10.2f}{t['detokenize']:>9.2f}")
    ratio = held["tok_per_s"] / free["tok_per_s"] if free["tok_per_s"] > 0 else math.nan
    # per CPU-second of the process: what other tenants of a shared machine take is not
    # counted, so this ratio moves less from run to run than the wall-time one
    cpu_ratio = max(x["tok_per_cpu_s"] for x in runs["half constrained"]) / max(
        x["tok_per_cpu_s"] for x in runs["free"])
    holds = ratio >= 0.8
    echo("")
    echo(f"a constrained output begins: {held['sample_text'][:100]!r}")
    echo(f"output tok/s, half constrained / free: {ratio:.2f}x (target >= 0.8): "
         f"{'holds' if holds else 'DOES NOT HOLD'}")
    echo(f"  the same per CPU-second            : {cpu_ratio:.2f}x")
    report = {"ratio": ratio, "cpu_ratio": cpu_ratio, "targets": {"half_constrained_0_8x_of_free": holds},
              "all_runs_tok_per_s": {n: [x["tok_per_s"] for x in rs] for n, rs in runs.items()}}
    if json_out:
        Path(json_out).write_text(json.dumps({"sizes": asdict(s), "results": results, **report}, indent=2))
    return {"results": results, **report}
