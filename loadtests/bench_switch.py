"""`lockgate bench switch`: two base models on a memory budget that holds one at a time.

Three measurements, each with its baseline in the same run:

1. cold start: the time the pool takes to bring a cold model in (offloading the other one
   and reading the weights back from the checkpoint), against the time to load the same
   model from disk into a fresh engine;
2. online TTFT for a cold model: model A is busy with a flood of offline requests; every
   `online_gap_s` an online request for model B arrives (B is cold each time: A's offline
   work brought A back in between). TTFT p50/p99 against the same requests sent to B alone
   (warm, idle);
3. switching's share of throughput: both models get the same number of offline requests,
   sent together, so the pool alternates between them. Output tokens/s against each
   model's workload run alone, one after the other, with no switch at all; the share of
   the wall time spent switching (offload + load) is what the target bounds (under 10%).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtests.bench_priority import allowed_token_ids, percentile


@dataclass(slots=True, frozen=True)
class SwitchSizes:
    num_online: int = 8
    online_gap_s: float = 1.0
    offline_flood: int = 64
    mix_requests: int = 48            # per model, for the alternating mix
    prompt: tuple[int, int] = (64, 192)
    output_len: int = 32
    num_kv_blocks: int = 1024
    switch_overhead: float = 0.1
    seed: int = 0
    num_threads: int | None = None


def demo_pair() -> tuple[str, str]:
    """Two `small` demo models (llama seed 0, qwen2 seed 1) in the user's cache."""
    import os

    from engine.demo_model import write_demo_model

    root = Path(os.environ.get("LOCKGATE_CACHE", Path.home() / ".cache" / "lockgate")) / "demo-models"
    out = []
    for family, seed in (("llama", 0), ("qwen2", 1)):
        path = root / f"{family}-small-seed{seed}"
        if not (path / "model.safetensors").is_file():
            write_demo_model(path, family=family, size="small", seed=seed)
        out.append(str(path))
    return out[0], out[1]


def _pool(a: str, b: str, s: SwitchSizes, budget: int | None):
    from engine.config import EngineConfig
    from engine.model_registry import ModelPool

    return ModelPool(EngineConfig(
        model=a, models={"b": b}, num_kv_blocks=s.num_kv_blocks, memory_budget=budget,
        switch_overhead=s.switch_overhead, seed=s.seed, num_threads=s.num_threads,
    ))


def _requests(model_dir: str, n: int, s: SwitchSizes, seed: int) -> list[list[int]]:
    allowed = allowed_token_ids(model_dir)
    rng = random.Random(seed)
    return [rng.choices(allowed, k=rng.randint(*s.prompt)) for _ in range(n)]


def _run_to_end(core) -> int:
    tokens = 0
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return tokens


def bench_switch(
    models: tuple[str, str] | None = None,
    *,
    sizes: SwitchSizes | None = None,
    json_out: str | None = None,
    echo=print,
) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore
    from engine.request import EngineRequest
    from engine.sampling_params import SamplingParams

    a, b = models or demo_pair()
    s = sizes or SwitchSizes()
    sp = SamplingParams(max_tokens=s.output_len, min_tokens=s.output_len, temperature=0.0, ignore_eos=True)
    probe = _pool(a, b, s, None)
    sizes_b = {n: m["memory_bytes"] for n, m in probe.stats()["models"].items()}
    name_a = probe.default
    budget = max(sizes_b.values()) + min(sizes_b.values()) // 2     # one model at a time
    del probe
    echo(f"models: {name_a} = {a}, b = {b}; footprints {', '.join(f'{n} {v / 2**20:.0f} MiB' for n, v in sizes_b.items())}; "
         f"budget {budget / 2**20:.0f} MiB (one at a time); switch_overhead {s.switch_overhead}")

    # 1. cold start vs loading from disk into a fresh engine
    pool = _pool(a, b, s, budget)
    cold = []
    for _ in range(3):
        t0 = time.perf_counter()
        pool._bring_in("b")
        t1 = time.perf_counter()
        pool._bring_in(name_a)
        cold.append(t1 - t0)
    disk = []
    for _ in range(3):
        t0 = time.perf_counter()
        EngineCore(EngineConfig(model=b, num_kv_blocks=s.num_kv_blocks, num_threads=s.num_threads))
        disk.append(time.perf_counter() - t0)
    cold_s, disk_s = min(cold), min(disk)
    echo(f"1. bring cold model b in: {cold_s * 1000:.0f} ms (best of 3; includes offloading {name_a}); "
         f"a fresh engine loading b from disk: {disk_s * 1000:.0f} ms; ratio {cold_s / disk_s:.2f}")

    # 2. online TTFT of a cold model while the other is busy with offline work
    online = _requests(b, s.num_online, s, s.seed + 1)
    flood = _requests(a, s.offline_flood, s, s.seed + 2)

    def online_ttfts(core, with_flood: bool) -> tuple[list[float], int]:
        if with_flood:
            for i, p in enumerate(flood):
                core.add_request(EngineRequest(f"off{i}", p, sp, service_class="offline"))
        sent: list[tuple[float, Any]] = []
        next_at = time.perf_counter() + s.online_gap_s / 2
        cold_hits = 0
        while len(sent) < len(online) or core.has_unfinished:
            now = time.perf_counter()
            if len(sent) < len(online) and now >= next_at:
                i = len(sent)
                if with_flood and not core.cores["b"].resident:
                    cold_hits += 1
                st = core.add_request(EngineRequest(f"on{i}", online[i], sp, service_class="online",
                                                    model="b" if with_flood else None))
                sent.append((time.time(), st))
                next_at = now + s.online_gap_s
            if core.has_unfinished:
                core.step()
            else:
                time.sleep(0.001)
            if with_flood and len(sent) == len(online) and all(st.first_token_time for _, st in sent):
                break
        ttft = [st.first_token_time - t for t, st in sent]
        return ttft, cold_hits

    warm_core = EngineCore(EngineConfig(model=b, num_kv_blocks=s.num_kv_blocks, num_threads=s.num_threads))
    warm, _ = online_ttfts(warm_core, False)
    pool = _pool(a, b, s, budget)
    pool._bring_in(name_a)
    busy, cold_hits = online_ttfts(pool, True)
    while pool.has_unfinished:   # drain the flood
        pool.step()
    echo(f"2. online TTFT for model b, {s.num_online} requests every {s.online_gap_s:.1f} s: "
         f"while {name_a} runs {s.offline_flood} offline requests (b cold for {cold_hits} of them) "
         f"p50 {percentile(busy, 50) * 1000:.0f} ms, p99 {percentile(busy, 99) * 1000:.0f} ms; "
         f"b alone and warm p50 {percentile(warm, 50) * 1000:.0f} ms, p99 {percentile(warm, 99) * 1000:.0f} ms")

    # 3. alternating mix vs each workload alone
    work = {name_a: _requests(a, s.mix_requests, s, s.seed + 3), "b": _requests(b, s.mix_requests, s, s.seed + 4)}
    alone_s, alone_tokens = 0.0, 0
    for name, path in ((name_a, a), ("b", b)):
        core = EngineCore(EngineConfig(model=path, num_kv_blocks=s.num_kv_blocks, num_threads=s.num_threads))
        t0 = time.perf_counter()
        for i, p in enumerate(work[name]):
            core.add_request(EngineRequest(f"{name}{i}", p, sp, service_class="offline"))
        alone_tokens += _run_to_end(core)
        alone_s += time.perf_counter() - t0
    pool = _pool(a, b, s, budget)
    switches0, switch_s0 = pool.num_switches, pool.switch_s_total
    t0 = time.perf_counter()
    for i in range(s.mix_requests):
        for name in (name_a, "b"):
            pool.add_request(EngineRequest(f"{name}{i}", work[name][i], sp, service_class="offline",
                                           model=None if name == name_a else "b"))
    mix_tokens = _run_to_end(pool)
    mix_s = time.perf_counter() - t0
    switches = pool.num_switches - switches0
    switch_s = pool.switch_s_total - switch_s0
    share = switch_s / mix_s if mix_s > 0 else math.nan
    tput_ratio = (mix_tokens / mix_s) / (alone_tokens / alone_s)
    echo(f"3. alternating mix, {s.mix_requests} offline requests per model sent together: "
         f"{mix_tokens / mix_s:.0f} out tok/s vs {alone_tokens / alone_s:.0f} each alone one after the other "
         f"({tput_ratio:.2f}x); {switches} switches took {switch_s:.2f} s of {mix_s:.2f} s = {share * 100:.1f}% "
         f"(target < 10%): {'holds' if share < 0.1 else 'DOES NOT HOLD'}")
    report = {
        "cold_start_s": cold_s, "disk_load_s": disk_s,
        "online_ttft_cold_p50_s": percentile(busy, 50), "online_ttft_cold_p99_s": percentile(busy, 99),
        "online_ttft_warm_p50_s": percentile(warm, 50), "online_ttft_warm_p99_s": percentile(warm, 99),
        "cold_hits": cold_hits, "mix_tok_s": mix_tokens / mix_s, "alone_tok_s": alone_tokens / alone_s,
        "throughput_ratio": tput_ratio, "switches": switches, "switch_share": share,
        "targets": {"switching_under_10pct": share < 0.1},
    }
    if json_out:
        Path(json_out).write_text(json.dumps({"sizes": asdict(s), **report}, indent=2))
    return report
