"""`lockgate bench kv-tier`: the host-memory KV tier on vs off (engine/kv_cache/host_tier.py).

Chat: `conversations` multi-turn chats of `turns` turns each, sent one request at a time
(turn 1 of every chat, then turn 2 ...). Chat c opens on shared history c % `histories` (a
document of `history` tokens: the chats on one history share it), and each turn adds a user
message of `user` tokens and `output_len` forced answer tokens. The device KV cache
(`device_blocks` blocks) holds about one chat, so by the time a chat's next turn comes its
prefix was evicted from the device: with the tier, it is copied back; without, recomputed.
TTFT is compared over the turns the tier served (the requests that hit the host tier); the
prompt tokens computed are summed over every request, beside the block-aligned count of
tokens never seen before (what a tier that keeps everything must still compute).

No reuse: `nr_requests` distinct random prompts sent together, at most `nr_max_seqs` running
in a device cache of `nr_device_blocks` that holds them (no preemption, whose recompute the
tier would save) but not every finished one's cached blocks: each evicted block is copied to
the tier and none is ever hit, which prices the tier's overhead: tokens (prompt + output) per
second, on vs off.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from lockgate.loadtests.bench_priority import allowed_token_ids, default_model_dir, run_sides, warm_up
from lockgate.loadtests.stats import percentile


@dataclass(slots=True, frozen=True)
class KVTierSizes:
    conversations: int = 16
    turns: int = 6
    histories: int = 4
    history: tuple[int, int] = (1024, 1536)
    user: tuple[int, int] = (24, 40)
    output_len: int = 8
    device_blocks: int = 128
    block_size: int = 16
    offload_gib: float = 0.25
    nr_requests: int = 48
    nr_prompt: tuple[int, int] = (256, 768)
    nr_output: int = 32
    nr_device_blocks: int = 1024    # room for nr_max_seqs at once: evictions, no preemption
    nr_max_seqs: int = 16
    seed: int = 0
    num_threads: int | None = None


def chat_turns(s: KVTierSizes, allowed: list[int]) -> list[tuple[int, list[int]]]:
    """(chat, the new tokens its turn adds before the answer), in sending order."""
    rng = random.Random(s.seed)
    docs = [rng.choices(allowed, k=rng.randint(*s.history)) for _ in range(s.histories)]
    out = []
    for t in range(s.turns):
        for c in range(s.conversations):
            user = rng.choices(allowed, k=rng.randint(*s.user))
            out.append((c, (docs[c % s.histories] if t == 0 else []) + user))
    return out


def never_seen(prompts: list[list[int]], answers: list[list[int]], bs: int) -> int:
    """Prompt tokens no cache can serve: past the longest run of full blocks, from the first,
    that an earlier request computed (its prompt and answer but the last token); at least
    the last token of each prompt."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        hit = 0
        while hit < (len(prompt) - 1) // bs and tuple(prompt[:(hit + 1) * bs]) in seen:
            hit += 1
        total += len(prompt) - hit * bs
        done = prompt + answer[:-1]
        seen.update(tuple(done[:(i + 1) * bs]) for i in range(len(done) // bs))
    return total


def _core(model_dir: str, tier: bool, s: KVTierSizes, **overrides: Any):
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.engine_core import EngineCore

    return EngineCore(EngineConfig(**{
        "model": model_dir, "num_kv_blocks": s.device_blocks, "block_size": s.block_size, "seed": s.seed,
        "kv_offloading_size": s.offload_gib if tier else 0, "num_threads": s.num_threads, **overrides}))


def run_chat(model_dir: str, tier: bool, sizes: dict[str, Any]) -> dict[str, Any]:
    """The chat workload on one engine: per request its TTFT, prompt, answer, cached tokens
    and host-tier hits."""
    from lockgate.engine.request import EngineRequest
    from lockgate.engine.sampling_params import SamplingParams

    s = KVTierSizes(**sizes)
    core = _core(model_dir, tier, s)
    allowed = allowed_token_ids(model_dir)
    warm_up(core, allowed)
    sp = SamplingParams(max_tokens=s.output_len, min_tokens=s.output_len, temperature=0.0, ignore_eos=True)
    history: dict[int, list[int]] = {}
    rows = []
    for i, (chat, new) in enumerate(chat_turns(s, allowed)):
        prompt = history.get(chat, []) + new
        host_hits = core.kv.stats().host_hits
        sent = time.time()
        state = core.add_request(EngineRequest(f"c{i}", prompt, sp, tenant="acme"))
        while core.has_unfinished:
            core.step()
        answer = list(state.seqs[0].output_token_ids)
        rows.append({"ttft_s": state.first_token_time - sent, "prompt": prompt, "answer": answer,
                     "cached": state.num_cached_tokens, "host_hits": core.kv.stats().host_hits - host_hits})
        history[chat] = prompt + answer
    return {"rows": rows, "kv": asdict(core.kv.stats())}


def run_no_reuse(model_dir: str, tier: bool, sizes: dict[str, Any]) -> dict[str, Any]:
    from lockgate.engine.request import EngineRequest
    from lockgate.engine.sampling_params import SamplingParams

    s = KVTierSizes(**sizes)
    core = _core(model_dir, tier, s, num_kv_blocks=s.nr_device_blocks, max_num_seqs=s.nr_max_seqs)
    allowed = allowed_token_ids(model_dir)
    warm_up(core, allowed)
    rng = random.Random(s.seed + 1)
    prompts = [rng.choices(allowed, k=rng.randint(*s.nr_prompt)) for _ in range(s.nr_requests)]
    sp = SamplingParams(max_tokens=s.nr_output, min_tokens=s.nr_output, temperature=0.0, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"n{i}", p, sp, tenant="acme"))
    while core.has_unfinished:
        core.step()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(p) for p in prompts) + s.nr_requests * s.nr_output
    # tokens per CPU second too: on a shared machine wall time mostly measures the neighbours
    return {"tok_s": tokens / elapsed, "tok_cpu_s": tokens / cpu, "elapsed_s": elapsed,
            "kv": asdict(core.kv.stats()), "preemptions": core.scheduler.num_preemptions}


def chat_summary(on: dict[str, Any], off: dict[str, Any], bs: int) -> dict[str, Any]:
    """TTFT over the turns the tier served (on) and the same turns without it (off)."""
    served = [i for i, r in enumerate(on["rows"]) if r["host_hits"] > 0]
    out: dict[str, Any] = {"served_turns": len(served)}
    for name, side in (("on", on), ("off", off)):
        ttft = [side["rows"][i]["ttft_s"] for i in served] or [float("nan")]
        rows = side["rows"]
        out[name] = {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                     "computed": sum(len(r["prompt"]) - r["cached"] for r in rows),
                     "host_hits": side["kv"]["host_hits"], "copy_ins": side["kv"]["host_copy_ins"]}
    rows = on["rows"]
    out["never_seen"] = never_seen([r["prompt"] for r in rows], [r["answer"] for r in rows], bs)
    out["same_output"] = [r["answer"] for r in on["rows"]] == [r["answer"] for r in off["rows"]]
    return out


def bench_kv_tier(model_dir: str | None = None, *, sizes: KVTierSizes | None = None, repeats: int = 3,
                  fresh_process: bool = True, echo=print) -> dict[str, Any]:
    """Both workloads, tier on and off alternating, each side best of `repeats`."""
    model_dir = str(model_dir or default_model_dir())
    s = sizes or KVTierSizes()
    echo(f"model {model_dir}; device KV cache {s.device_blocks} blocks of {s.block_size}, host tier "
         f"{s.offload_gib} GiB; chat: {s.conversations} chats x {s.turns} turns on {s.histories} histories of "
         f"{s.history[0]}-{s.history[1]} tokens; no reuse: {s.nr_requests} prompts of "
         f"{s.nr_prompt[0]}-{s.nr_prompt[1]} tokens, {s.nr_output} out, together")
    chats: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    flows: dict[str, list[float]] = {"on": [], "off": []}
    cpu_flows: dict[str, list[float]] = {"on": [], "off": []}
    last: dict[str, dict[str, Any]] = {}
    for r in range(repeats):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        sides = {f"chat {k} #{r + 1}": (run_chat, (model_dir, k == "on", asdict(s))) for k in order}
        sides |= {f"no-reuse {k} #{r + 1}": (run_no_reuse, (model_dir, k == "on", asdict(s))) for k in order}
        got = run_sides(sides, fresh_process, echo)
        for k in order:
            chats[k].append(got[f"chat {k} #{r + 1}"])
            flows[k].append(got[f"no-reuse {k} #{r + 1}"]["tok_s"])
            cpu_flows[k].append(got[f"no-reuse {k} #{r + 1}"]["tok_cpu_s"])
            last[k] = got[f"no-reuse {k} #{r + 1}"]
    runs = [chat_summary(on, off, s.block_size) for on, off in zip(chats["on"], chats["off"], strict=True)]
    best = {k: {m: min(x[k][m] for x in runs) for m in ("ttft_p50_s", "ttft_p99_s")} for k in ("on", "off")}
    ratio50 = best["off"]["ttft_p50_s"] / best["on"]["ttft_p50_s"]
    ratio99 = best["off"]["ttft_p99_s"] / best["on"]["ttft_p99_s"]
    tput = max(flows["on"]) / max(flows["off"])
    first = runs[0]
    echo("")
    echo(f"chat, over the {first['served_turns']} turns the tier served (best of {repeats}):")
    echo(f"{'':<10}{'TTFT p50 ms':>12}{'TTFT p99 ms':>12}{'prompt tokens computed':>24}")
    for k in ("on", "off"):
        echo(f"tier {k:<5}{best[k]['ttft_p50_s'] * 1000:>12.1f}{best[k]['ttft_p99_s'] * 1000:>12.1f}"
             f"{first[k]['computed']:>24}")
    echo(f"never seen before (block-aligned): {first['never_seen']}; outputs equal on vs off: "
         f"{all(x['same_output'] for x in runs)}")
    ok = {True: "holds", False: "DOES NOT HOLD"}
    echo(f"TTFT off / on: p50 {ratio50:.2f}x, p99 {ratio99:.2f}x (target >= 3): {ok[min(ratio50, ratio99) >= 3]}")
    echo(f"no reuse, tokens/s best of {repeats}: on {max(flows['on']):.0f}, off {max(flows['off']):.0f}: "
         f"{tput:.3f}x (target >= 0.97): {ok[tput >= 0.97]}")
    cpu_ratio = max(cpu_flows["on"]) / max(cpu_flows["off"])
    echo(f"  per CPU second: on {max(cpu_flows['on']):.0f}, off {max(cpu_flows['off']):.0f}: {cpu_ratio:.3f}x")
    kv = last["on"]["kv"]
    echo(f"  (tier on: {kv['host_stores']} blocks stored to the host, {kv['host_copy_ins']} copied back; "
         f"preemptions on/off {last['on']['preemptions']}/{last['off']['preemptions']})")
    return {"runs": runs, "best": best, "ttft_ratio_p50": ratio50, "ttft_ratio_p99": ratio99,
            "no_reuse_tok_s": flows, "no_reuse_ratio": tput, "no_reuse_cpu_ratio": cpu_ratio}
