"""`lockgate bench switch`: two base models on a memory budget that holds one at a time.

Three measurements, each with its baseline in the same run:

1. cold start: the time the pool takes to bring a cold model in (offloading the other one
   and reading the weights back from the checkpoint), against the time to load the same
   model from disk into a fresh engine;
2. online TTFT for a cold model: model A is kept busy with `offline_flood` outstanding
   offline requests; every `online_gap_s` an online request for model B arrives (B is cold
   each time: A's offline work brought A back in between). TTFT p50/p99 against the same requests sent to B alone
   (warm, idle);
3. switching's share of throughput: both models kept busy (closed loop: `mix_outstanding`
   offline requests each, a new one for every one that finishes) for `mix_duration_s`, so
   the pool alternates between them, against each model alone, busy the same way, for half
   that time (no switch at all). Throughput lost = 1 - mixed / alone output tokens/s: what
   switching costs in all (loads, offloads, the drain at the end of each turn, cold caches),
   which the target bounds (under 10%).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lockgate.loadtests.bench_priority import allowed_token_ids
from lockgate.loadtests.bench_throughput import default_model_dir
from lockgate.loadtests.stats import percentile


@dataclass(slots=True, frozen=True)
class SwitchSizes:
    num_online: int = 8
    online_gap_s: float = 1.0
    offline_flood: int = 64
    mix_outstanding: int = 32         # per model, kept outstanding in the mix
    mix_duration_s: float = 8.0
    prompt: tuple[int, int] = (64, 192)
    output_len: int = 32
    num_kv_blocks: int = 1024
    switch_overhead: float = 0.1
    seed: int = 0
    num_threads: int | None = None


def demo_pair() -> tuple[str, str]:
    """Two `small` demo models (llama seed 0, qwen2 seed 1) in the user's cache."""
    return str(default_model_dir("llama", 0)), str(default_model_dir("qwen2", 1))


@dataclass(slots=True, frozen=True)
class _Setup:
    """What every measurement shares: model a (the pool's default, `name_a`) and model b, a
    memory budget that holds one of them, the sizes, and each request's sampling (forced
    output length)."""
    a: str
    b: str
    name_a: str
    budget: int
    s: SwitchSizes
    sp: Any

    def pool(self):
        return _pool(self.a, self.b, self.s, self.budget)

    def engine(self, model_dir: str):
        """A fresh engine of one model alone, loaded from disk."""
        from lockgate.engine.config import EngineConfig
        from lockgate.engine.engine_core import EngineCore

        return EngineCore(EngineConfig(model=model_dir, num_kv_blocks=self.s.num_kv_blocks,
                                       num_threads=self.s.num_threads))


def _pool(a: str, b: str, s: SwitchSizes, budget: int | None):
    from lockgate.engine.config import EngineConfig
    from lockgate.engine.model_pool import ModelPool

    return ModelPool(EngineConfig(
        model=a, models={"b": b}, num_kv_blocks=s.num_kv_blocks, memory_budget=budget,
        switch_overhead=s.switch_overhead, seed=s.seed, num_threads=s.num_threads,
    ))


def _setup(a: str, b: str, s: SwitchSizes, echo) -> _Setup:
    """Both models' footprints, from a pool without a budget; the budget: the larger
    footprint and half the smaller, so one model fits at a time."""
    from lockgate.engine.sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=s.output_len, min_tokens=s.output_len, temperature=0.0, ignore_eos=True)
    probe = _pool(a, b, s, None)
    sizes_b = {n: m.memory_bytes for n, m in probe.stats().pool.models.items()}
    name_a = probe.default
    budget = max(sizes_b.values()) + min(sizes_b.values()) // 2     # one model at a time
    del probe
    footprints = ", ".join(f"{n} {v / 2**20:.0f} MiB" for n, v in sizes_b.items())
    echo(f"models: {name_a} = {a}, b = {b}; footprints {footprints}; "
         f"budget {budget / 2**20:.0f} MiB (one at a time); switch_overhead {s.switch_overhead}")
    return _Setup(a, b, name_a, budget, s, sp)


def _requests(model_dir: str, n: int, s: SwitchSizes, seed: int) -> list[list[int]]:
    allowed = allowed_token_ids(model_dir)
    rng = random.Random(seed)
    return [rng.choices(allowed, k=rng.randint(*s.prompt)) for _ in range(n)]


# -- 1. cold start ------------------------------------------------------------------------------
def _cold_start(setup: _Setup) -> tuple[float, float]:
    """The best of 3 of the pool bringing cold model b in (offloading a), and of a fresh
    engine loading b from disk."""
    pool = setup.pool()
    cold = []
    for _ in range(3):
        t0 = time.perf_counter()
        pool._bring_in("b")
        t1 = time.perf_counter()
        pool._bring_in(setup.name_a)
        cold.append(t1 - t0)
    disk = []
    for _ in range(3):
        t0 = time.perf_counter()
        setup.engine(setup.b)
        disk.append(time.perf_counter() - t0)
    return min(cold), min(disk)


# -- 2. online TTFT of a cold model -------------------------------------------------------------
def _online_ttfts(core, setup: _Setup, online: list[list[int]], flood: list[list[int]] | None,
                  ) -> tuple[list[float], int]:
    """Each online request's TTFT, one every `online_gap_s`, to model b: on `core` alone, or
    (`flood` given) on a pool whose model a is kept busy with offline requests until the
    last online one is in. Also how many found b cold."""
    from lockgate.engine.request import EngineRequest

    s, sp, with_flood = setup.s, setup.sp, flood is not None
    num_off = 0

    def top_up() -> None:   # model a stays busy until the last online request is in
        nonlocal num_off
        while len(core.cores[setup.name_a].requests) < s.offline_flood:
            core.add_request(EngineRequest(f"off{num_off}", flood[num_off % len(flood)], sp,
                                           service_class="offline"))
            num_off += 1

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
        if with_flood and len(sent) < len(online):
            top_up()
        if core.has_unfinished:
            core.step()
        else:
            time.sleep(0.001)
        if with_flood and len(sent) == len(online) and all(st.first_token_time for _, st in sent):
            break
    return [st.first_token_time - t for t, st in sent], cold_hits


def _cold_model_ttft(setup: _Setup) -> tuple[list[float], list[float], int]:
    """The online requests' TTFTs on model b warm and alone, then on the pool while a runs
    the offline flood; and how many found b cold."""
    s = setup.s
    online = _requests(setup.b, s.num_online, s, s.seed + 1)
    flood = _requests(setup.a, s.offline_flood, s, s.seed + 2)
    warm, _ = _online_ttfts(setup.engine(setup.b), setup, online, None)
    pool = setup.pool()
    pool._bring_in(setup.name_a)
    busy, cold_hits = _online_ttfts(pool, setup, online, flood)
    while pool.has_unfinished:   # drain the flood
        pool.step()
    return warm, busy, cold_hits


# -- 3. switching's share of throughput ---------------------------------------------------------
def _closed_loop(core, setup: _Setup, names: list[str], duration: float) -> tuple[int, float]:
    """`mix_outstanding` offline requests kept outstanding for each model of `names` (a new
    one for every one that finishes) for `duration` seconds: the output tokens of the
    requests that finished, and the seconds."""
    from lockgate.engine.request import EngineRequest

    s, name_a = setup.s, setup.name_a
    rng = random.Random(s.seed + 5)
    allowed = {n: allowed_token_ids(setup.a if n == name_a else setup.b) for n in names}
    counter = 0

    def send(n: str) -> None:
        nonlocal counter
        ids = rng.choices(allowed[n], k=rng.randint(*s.prompt))
        core.add_request(EngineRequest(f"{n}-{counter}", ids, setup.sp, service_class="offline",
                                       model=None if n == name_a or len(names) == 1 else n))
        counter += 1

    owner: dict[str, str] = {}
    for n in names:
        for _ in range(s.mix_outstanding):
            owner[f"{n}-{counter}"] = n
            send(n)
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < duration:
        for out in core.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
                n = owner.pop(out.request_id)
                owner[f"{n}-{counter}"] = n
                send(n)
    elapsed = time.perf_counter() - t0
    for rid in list(owner):
        core.abort_request(rid)
    return tokens, elapsed


def _switching_share(setup: _Setup) -> dict[str, Any]:
    """Both models kept busy on the pool for `mix_duration_s`, against each alone on an
    engine of its own for half that time: the throughputs, their ratio, the switches and
    the seconds they took."""
    s = setup.s
    alone_tokens, alone_s = 0, 0.0
    for name, path in ((setup.name_a, setup.a), ("b", setup.b)):
        tok, el = _closed_loop(setup.engine(path), setup, [name], s.mix_duration_s / 2)
        alone_tokens += tok
        alone_s += el
    pool = setup.pool()
    switches0, switch_s0 = pool.num_switches, pool.switch_s_total
    mix_tokens, mix_s = _closed_loop(pool, setup, [setup.name_a, "b"], s.mix_duration_s)
    tput_ratio = (mix_tokens / mix_s) / (alone_tokens / alone_s)
    return {"mix_tok_s": mix_tokens / mix_s, "alone_tok_s": alone_tokens / alone_s,
            "throughput_ratio": tput_ratio, "switches": pool.num_switches - switches0,
            "switch_load_s": pool.switch_s_total - switch_s0, "mix_s": mix_s}


# -- the command --------------------------------------------------------------------------------
def bench_switch(
    models: tuple[str, str] | None = None,
    *,
    sizes: SwitchSizes | None = None,
    json_out: str | None = None,
    echo=print,
) -> dict[str, Any]:
    a, b = models or demo_pair()
    s = sizes or SwitchSizes()
    setup = _setup(a, b, s, echo)
    name_a = setup.name_a

    cold_s, disk_s = _cold_start(setup)
    echo(f"1. bring cold model b in: {cold_s * 1000:.0f} ms (best of 3; includes offloading {name_a}); "
         f"a fresh engine loading b from disk: {disk_s * 1000:.0f} ms; ratio {cold_s / disk_s:.2f}")

    warm, busy, cold_hits = _cold_model_ttft(setup)
    echo(f"2. online TTFT for model b, {s.num_online} requests every {s.online_gap_s:.1f} s: "
         f"while {name_a} runs {s.offline_flood} offline requests (b cold for {cold_hits} of them) "
         f"p50 {percentile(busy, 50) * 1000:.0f} ms, p99 {percentile(busy, 99) * 1000:.0f} ms; "
         f"b alone and warm p50 {percentile(warm, 50) * 1000:.0f} ms, p99 {percentile(warm, 99) * 1000:.0f} ms")

    mix = _switching_share(setup)
    share = max(0.0, 1.0 - mix["throughput_ratio"])
    echo(f"3. both models kept busy ({s.mix_outstanding} offline requests outstanding each) for "
         f"{s.mix_duration_s:.0f} s: {mix['mix_tok_s']:.0f} out tok/s vs {mix['alone_tok_s']:.0f} "
         f"with each model alone for half the time ({mix['throughput_ratio']:.2f}x); {mix['switches']} "
         f"switches, loading and offloading took {mix['switch_load_s']:.2f} s "
         f"({mix['switch_load_s'] / mix['mix_s'] * 100:.1f}% of the time)")
    echo(f"   throughput lost to switching: {share * 100:.1f}% (target < 10%): "
         f"{'holds' if share < 0.1 else 'DOES NOT HOLD'}")
    report = {
        "cold_start_s": cold_s, "disk_load_s": disk_s,
        "online_ttft_cold_p50_s": percentile(busy, 50), "online_ttft_cold_p99_s": percentile(busy, 99),
        "online_ttft_warm_p50_s": percentile(warm, 50), "online_ttft_warm_p99_s": percentile(warm, 99),
        "cold_hits": cold_hits, "mix_tok_s": mix["mix_tok_s"], "alone_tok_s": mix["alone_tok_s"],
        "throughput_ratio": mix["throughput_ratio"], "switches": mix["switches"],
        "switch_load_s": mix["switch_load_s"], "switch_share": share,
        "targets": {"switching_under_10pct": share < 0.1},
    }
    if json_out:
        Path(json_out).write_text(json.dumps({"sizes": asdict(s), **report}, indent=2))
    return report
