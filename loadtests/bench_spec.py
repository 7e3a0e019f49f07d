"""`lockgate bench spec`: speculative decoding on against off, side by side in one run.

Two workloads:

- copy-heavy, on the `--copy` demo model (engine/spec/copy_model.py), whose greedy output
  quotes its prompt as real models quote code they edit: each prompt is a source (four
  sentences of the demo tokenizer's text, or a random span) followed by its first tokens
  again, so the answer repeats the source;
- random text, on the small demo model (built never to copy: its greedy text does not repeat
  itself, where the copy model's, with nothing to quote, falls into a loop it then quotes):
  random prompts, so n-gram proposals are found and rejected, and speculation must cost
  next to nothing.

Each at batch 1 (one request at a time, `max_num_seqs` 1) and batch 32: output tokens/s and
the drafts' acceptance (accepted / proposed), with speculation off and on (n-gram), and on the
copy-heavy workload a third side, "draft": the copy model's draft model (`--copy --draft`,
engine/spec/draft_model.py) proposing. Each side runs in a fresh process, the sides in turn
(reversed every other round), the best of `repeats` runs counting. Every side's greedy tokens
are compared with the others': speculation is lossless, so they must be equal.

Then the flood: an online trickle (copy-heavy prompts, one every `probe_interval_s`) beside an
offline flood kept at `flood_size` requests, driven in real time through `EngineCore` as
`bench priority` does; the online TTFT p99 with speculation on against off (target: at most
1.1x), since drafts must never cost the class a person is waiting on.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockgate.loadtests.bench_throughput import _in_fresh_process, default_model_dir
from lockgate.loadtests.cache import cache_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
QUOTE_FROM = 6          # a copy prompt repeats its source's first tokens, then the model quotes on


@dataclass(frozen=True, slots=True)
class SpecCase:
    """`num_requests` prompts of one workload, each forced to `output_len` tokens, at most
    `batch` running at once."""

    workload: str           # "copy" or "random"
    batch: int
    num_requests: int
    output_len: int

    @property
    def name(self) -> str:
        return f"{'copy-heavy' if self.workload == 'copy' else 'random text'}, batch {self.batch}"


def default_cases() -> list[SpecCase]:
    # a few seconds a run: sub-second runs measured start-up jitter more than decoding
    return [SpecCase("copy", 1, 32, 64), SpecCase("random", 1, 32, 64),
            SpecCase("copy", 32, 128, 64), SpecCase("random", 32, 128, 64)]


def copy_model_dir() -> Path:
    """The copy demo model, written once into the bench cache."""
    from lockgate.engine import write_copy_model

    out = cache_dir() / "demo-models" / "copy-tiny-seed0"
    if not (out / "config.json").exists():
        write_copy_model(out)
    return out


def copy_draft_dir() -> Path:
    """The copy model's draft model, written once into the bench cache."""
    from lockgate.engine import write_copy_model

    out = cache_dir() / "demo-models" / "copy-draft-tiny-seed0"
    if not (out / "config.json").exists():
        write_copy_model(out, draft=True)
    return out


def spec_config(side: str) -> dict[str, Any] | None:
    """The speculative_config of a side: "off", "on" (n-gram) or "draft" (the draft model)."""
    if side == "draft":
        return {"model": str(copy_draft_dir()), "num_speculative_tokens": NGRAM["num_speculative_tokens"]}
    return dict(NGRAM) if side == "on" else None


def prompts_for(model_dir: str, workload: str, num: int, seed: int) -> list[list[int]]:
    from lockgate.engine import Tokenizer
    from lockgate.engine.demo_tokenizer import _corpus

    rng = random.Random(seed)
    tok = Tokenizer(model_dir)
    vocab = tok.vocab_size
    out = []
    for i in range(num):
        if workload == "random":
            out.append([rng.randrange(3, vocab) for _ in range(64)])
            continue
        if i % 2:
            source = [rng.randrange(3, vocab) for _ in range(60)]
        else:
            start = rng.randrange(0, len(_corpus()) - 4)
            source = tok.encode(" ".join(_corpus()[start:start + 4]))
        out.append(source + source[:QUOTE_FROM])
    return out


def _spec_counts(engine: Any) -> tuple[int, int]:
    """(draft tokens proposed, accepted) so far, from the engine's stats."""
    spec = engine.stats().spec
    return spec.num_draft_tokens, spec.num_accepted_tokens


def run_side(copy_dir: str, case: SpecCase, side: str, seed: int) -> dict[str, Any]:
    """One side ("off", "on" or "draft") in the process it is called in: the engine started
    and warmed, then the workload timed."""
    from lockgate.engine import LLM, SamplingParams

    model_dir = copy_dir if case.workload == "copy" else str(default_model_dir())
    prompts = prompts_for(model_dir, case.workload, case.num_requests, seed)
    llm = LLM(model_dir, dtype="float32", max_num_seqs=case.batch, enable_prefix_caching=False,
              speculative_config=spec_config(side))
    spec_on = side != "off"
    try:
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8), use_progress_bar=False)
        drafts0, accepted0 = _spec_counts(llm.engine) if spec_on else (0, 0)
        params = SamplingParams(max_tokens=case.output_len, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
        elapsed = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        drafts, accepted = _spec_counts(llm.engine) if spec_on else (0, 0)
    finally:
        llm.engine.shutdown()
    num = sum(map(len, tokens))
    return {"elapsed_s": elapsed, "output_tokens": num, "tok_s": num / elapsed,
            "draft_tokens": drafts - drafts0, "accepted_tokens": accepted - accepted0,
            "tokens_digest": hashlib.sha256(repr(tokens).encode()).hexdigest()[:16]}


@dataclass(frozen=True, slots=True)
class FloodSizes:
    flood_size: int = 16            # offline requests kept outstanding
    flood_prompt: int = 256
    flood_output: int = 128
    probes: int = 48                # online requests, one every probe_interval_s
    probe_interval_s: float = 0.25
    probe_output: int = 16
    warmup_s: float = 1.0
    seed: int = 0


def run_flood_side(model_dir: str, spec_on: bool, s: FloodSizes) -> dict[str, Any]:
    """Online TTFTs beside an offline flood, in real time through `EngineCore`."""
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.engine_core import EngineCore
    from lockgate.engine.request import EngineRequest
    from lockgate.engine.sampling_params import SamplingParams

    core = EngineCore(EngineConfig(model=model_dir, dtype="float32", seed=s.seed,
                                   speculative_config=dict(NGRAM) if spec_on else None))
    rng = random.Random(s.seed)
    vocab = core.model_config.vocab_size
    probes = prompts_for(model_dir, "copy", s.probes, s.seed + 1)
    flood: dict[str, Any] = {}
    added = 0

    def add_flood() -> None:
        nonlocal added
        ids = [rng.randrange(3, vocab) for _ in range(s.flood_prompt)]
        sp = SamplingParams(max_tokens=s.flood_output, temperature=0.0, ignore_eos=True)
        rid = f"off-{added}"
        added += 1
        flood[rid] = core.add_request(EngineRequest(rid, ids, sp, service_class="offline", tenant="batch"))

    for _ in range(s.flood_size):
        add_flood()
    online: list[tuple[float, Any]] = []
    start = time.time() + s.warmup_s
    while len(online) < s.probes or any(st.first_token_time is None for _, st in online):
        now = time.time()
        due = start + len(online) * s.probe_interval_s
        if len(online) < s.probes and now >= due:
            sp = SamplingParams(max_tokens=s.probe_output, temperature=0.0, ignore_eos=True)
            st = core.add_request(EngineRequest(f"on-{len(online)}", probes[len(online)], sp,
                                                service_class="online", tenant="chat"))
            online.append((due, st))
        for o in core.step():
            if o.finished and o.request_id in flood:
                del flood[o.request_id]
                add_flood()
    for rid in list(core.requests):      # the flood's last requests: not measured, given back
        core.abort_request(rid)
    core.shutdown()
    ttfts = sorted(st.first_token_time - due for due, st in online)
    return {"ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def bench_spec(cases: list[SpecCase] | None = None, *, repeats: int = 3, seed: int = 0,
               flood: FloodSizes | None = None, fresh_process: bool = True, echo=print) -> dict[str, Any]:
    model_dir = str(copy_model_dir())
    cases = cases if cases is not None else default_cases()
    echo(f"speculative decoding off vs on ({NGRAM}) vs draft (the copy model's draft); copy-heavy on "
         f"{model_dir}, random text on {default_model_dir()}; best of {repeats} alternating runs, each in a "
         "fresh process")
    out: dict[str, Any] = {"speculative_config": NGRAM, "draft_config": spec_config("draft"), "cases": {}}

    def run(fn, *args) -> dict[str, Any]:
        return _in_fresh_process(fn, *args) if fresh_process else fn(*args)

    for case in cases:
        out["cases"][case.name] = _run_case(run, model_dir, case, repeats, seed, echo)
    fl = flood or FloodSizes()
    flood_best: dict[str, dict[str, Any]] = {}
    for rep in range(repeats):
        for side, on in (("off", False), ("on", True)) if rep % 2 == 0 else (("on", True), ("off", False)):
            r = run(run_flood_side, model_dir, on, fl)
            echo(f"  online beside a flood run {rep + 1}/{repeats} spec {side:>3}: TTFT p99 "
                 f"{1000 * r['ttft_p99_s']:.1f} ms")
            if side not in flood_best or r["ttft_p99_s"] < flood_best[side]["ttft_p99_s"]:
                flood_best[side] = r
    out["flood"] = {"best": flood_best,
                    "ttft_p99_ratio": flood_best["on"]["ttft_p99_s"] / flood_best["off"]["ttft_p99_s"]}
    _report(out, echo)
    return out


def _run_case(run, model_dir: str, case: SpecCase, repeats: int, seed: int, echo) -> dict[str, Any]:
    """The sides of one case, best of `repeats` each: off, n-gram and (copy-heavy) the draft model."""
    sides = ["off", "on"] + (["draft"] if case.workload == "copy" else [])
    best: dict[str, dict[str, Any]] = {}
    digests: set[str] = set()
    for rep in range(repeats):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            r = run(run_side, model_dir, case, side, seed)
            digests.add(r["tokens_digest"])
            echo(f"  {case.name:<24} run {rep + 1}/{repeats} spec {side:>5}: {r['tok_s']:8.1f} tok/s"
                 + (f", accepted {r['accepted_tokens']}/{r['draft_tokens']}" if side != "off" else ""))
            if side not in best or r["elapsed_s"] < best[side]["elapsed_s"]:
                best[side] = r
    out = {"best": best, "ratio": best["on"]["tok_s"] / best["off"]["tok_s"], "identical": len(digests) == 1}
    if "draft" in best:
        out["draft_ratio"] = best["draft"]["tok_s"] / best["off"]["tok_s"]
    return out


def _report(out: dict[str, Any], echo) -> None:
    echo("")
    echo(f"{'workload':<26}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}{'acceptance':>12}"
         f"{'draft tok/s':>13}{'draft/off':>11}{'acceptance':>12}  identical")
    for name, c in out["cases"].items():
        on, off = c["best"]["on"], c["best"]["off"]
        draft = c["best"].get("draft")
        line = f"{name:<26}{off['tok_s']:>11.1f}{on['tok_s']:>10.1f}{c['ratio']:>7.2f}x{100 * _rate(on):>11.1f}%"
        line += (f"{draft['tok_s']:>13.1f}{c['draft_ratio']:>10.2f}x{100 * _rate(draft):>11.1f}%" if draft
                 else f"{'-':>13}{'-':>11}{'-':>12}")
        echo(f"{line}  {'yes' if c['identical'] else 'NO'}")
    f = out["flood"]
    echo(f"online TTFT p99 beside an offline flood: off {1000 * f['best']['off']['ttft_p99_s']:.1f} ms, "
         f"on {1000 * f['best']['on']['ttft_p99_s']:.1f} ms ({f['ttft_p99_ratio']:.2f}x; target <= 1.10x)")


def _rate(side: dict[str, Any]) -> float:
    return side["accepted_tokens"] / side["draft_tokens"] if side["draft_tokens"] else 0.0
