"""The engine benchmarks (`lockgate bench priority|fairness|prefix`) at tiny sizes on the tiny
model, run in this process: the harness and the result dicts, and the direction of an effect
only where it rests on counts (tokens, counters, steps), never on timings."""

from __future__ import annotations

import math

from lockgate.loadtests.bench_fairness import FairnessSizes, bench_fairness, jain, vtc_bound
from lockgate.loadtests.bench_kv_tier import KVTierSizes, bench_kv_tier
from lockgate.loadtests.bench_prefix import PrefixSizes, bench_prefix
from lockgate.loadtests.bench_priority import PrioritySizes, bench_priority
from lockgate.loadtests.stats import percentile
from tests.support.helpers import demo_model


def quiet(*_args, **_kwargs) -> None:
    pass


def test_percentile_and_jain():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert abs(percentile([1.0, 2.0], 99) - 1.99) < 1e-12
    assert math.isnan(percentile([], 50))
    assert jain([5.0, 5.0]) == 1.0
    assert abs(jain([4.0, 1.0]) - 25 / 34) < 1e-12


def test_bench_prefix_caching_computes_only_the_suffixes(tmp_path):
    sizes = PrefixSizes(num_requests=6, prefix_len=128, suffix=(4, 8), output_len=2)
    out = bench_prefix(demo_model("llama", "tiny", 0), sizes=sizes, fresh_process=False,
                       echo=quiet, json_out=str(tmp_path / "prefix.json"))
    on, off = out["results"]["caching on"], out["results"]["caching off"]
    assert on["prompt_tokens"] == off["prompt_tokens"]
    # 128 is a whole number of blocks: each later request hits the whole prefix
    assert on["cached_tokens"] == 5 * 128 and off["cached_tokens"] == 0
    assert off["prefill_tokens"] == off["prompt_tokens"]
    assert on["prefill_tokens"] == on["prompt_tokens"] - 5 * 128
    assert out["prefill_fewer"] >= 0.9 and out["targets"]["prefill_90pct_fewer"]
    for r in (on, off):
        assert r["ttft_p50_s"] > 0 and r["first"]["prefill_tokens"] > 128
    assert (tmp_path / "prefix.json").is_file()


def test_bench_fairness_priority_keeps_the_vtc_bound_and_fcfs_follows_the_load():
    sizes = FairnessSizes(num_steps=300, window_steps=25, light_outstanding=12, prompt=(16, 64),
                          output=(8, 32), num_kv_blocks=48)
    out = bench_fairness(demo_model("llama", "tiny", 0), sizes=sizes, fresh_process=False, echo=quiet)
    prio, fcfs = out["results"]["priority"], out["results"]["fcfs"]
    bound = vtc_bound(sizes, prio["max_model_len"])
    assert out["bound"] == bound and bound["M"] == 48 * 16
    for r in (prio, fcfs):
        assert r["num_steps"] == 300 and r["backlogged_steps"] > 250
        assert r["jain_windows"] and all(0.5 <= j <= 1.0 for j in r["jain_windows"])
        assert r["finished"]["heavy"] > 0 and r["finished"]["light"] > 0
    # counts only: the schedule is the same on any machine
    assert prio["gap_max"] <= bound["2U"] and out["targets"]["bound_holds"]
    assert prio["counter_gap_max"] <= bound["U"]
    assert 0.4 <= prio["heavy_share"] <= 0.6
    assert fcfs["heavy_share"] > 0.7
    assert prio["gap_max"] < fcfs["gap_max"]
    assert prio["jain_min"] > fcfs["jain_min"]


def test_bench_priority_runs_four_ways_and_online_never_waits_past_the_next_step(tmp_path):
    sizes = PrioritySizes(duration_s=2.5, warmup_s=0.5, drain_s=3.0, online_rate=4.0,
                          online_prompt=(8, 16), online_output=(4, 8), offline_outstanding=8,
                          offline_prompt=(64, 128), offline_output=32, num_kv_blocks=48,
                          online_kv_reserve=0.25)
    out = bench_priority(demo_model("llama", "tiny", 0), sizes=sizes, fresh_process=False,
                         echo=quiet, json_out=str(tmp_path / "priority.json"))
    res = out["results"]
    assert set(res) == {"online", "offline", "fcfs", "priority"}
    n = res["online"]["online"]["requests"]
    assert n > 0
    for mode in ("online", "fcfs", "priority"):
        o = res[mode]["online"]
        assert o["requests"] == n          # the same arrivals in every run
        assert 0 < o["ttft_p50_s"] <= o["ttft_p99_s"] <= o["ttft_max_s"]
    for mode in ("offline", "fcfs", "priority"):
        f = res[mode]["offline"]
        assert f["output_tokens"] > 0 and f["tokens_per_s"] > 0
        assert res[mode]["steps"]["in_window"] > 0
    assert res["online"]["offline"] is None and res["offline"]["online"] is None
    # under priority an online request always goes into the first step that starts after
    # it arrives (class first; the online reserve means it never waits for blocks)
    assert res["priority"]["online"]["censored"] == 0
    assert res["priority"]["online"]["steps_waited_max"] == 0
    assert res["priority"]["preemptions"]["online"] == 0
    assert out["targets"]["online_never_waits_past_next_step"]
    assert set(out["targets"]) >= {"ttft_p99_within_bound", "ttft_p99_10x_below_fcfs",
                                   "offline_throughput_85pct"}
    assert (tmp_path / "priority.json").is_file()


def test_bench_lora_runs_both_sides_with_every_adapter_in_the_batch(tmp_path):
    from lockgate.loadtests.bench_lora import LoraSizes, bench_lora

    sizes = LoraSizes(num_requests=8, num_adapters=3, rank=4, prompt=(8, 24), output_len=4, repeats=1)
    out = bench_lora(demo_model("llama", "tiny", 0), sizes=sizes, fresh_process=False, echo=quiet,
                     json_out=str(tmp_path / "lora.json"))
    base, lora = out["results"]["base"], out["results"]["3 adapters"]
    assert base["output_tokens"] == lora["output_tokens"] == 8 * 4
    assert lora["max_adapters_running"] == 3 and lora["lora_stats"]["slot_loads"] == 3
    assert base["lora_stats"] is None
    assert out["ratio"] > 0 and (tmp_path / "lora.json").is_file()


def test_bench_switch_switches_and_keeps_the_budget(tmp_path):
    from lockgate.loadtests.bench_switch import SwitchSizes, bench_switch

    sizes = SwitchSizes(num_online=2, online_gap_s=0.05, offline_flood=6, mix_outstanding=4, mix_duration_s=1.0,
                        prompt=(8, 24), output_len=4, num_kv_blocks=32)
    out = bench_switch((demo_model("llama", "tiny", 0), demo_model("qwen2", "tiny", 1)), sizes=sizes,
                       echo=quiet, json_out=str(tmp_path / "switch.json"))
    assert out["switches"] >= 1 and out["cold_start_s"] > 0 and out["disk_load_s"] > 0
    assert out["online_ttft_cold_p99_s"] > 0 and 0 <= out["switch_share"] < 1
    assert (tmp_path / "switch.json").is_file()


def test_bench_kv_tier_serves_evicted_prefixes_from_the_host():
    """4 chats x 2 turns on 2 histories, a device cache of one chat: the tier's side
    computes only the tokens never seen before, the other side much more."""
    sizes = KVTierSizes(conversations=4, turns=2, histories=2, history=(160, 200), user=(8, 16), output_len=2,
                        device_blocks=24, offload_gib=0.01, nr_requests=4, nr_prompt=(32, 64), nr_output=2,
                        nr_device_blocks=24, nr_max_seqs=2)
    out = bench_kv_tier(demo_model("llama", "tiny", 0), sizes=sizes, repeats=1, fresh_process=False, echo=quiet)
    run = out["runs"][0]
    assert run["same_output"] and run["on"]["computed"] == run["never_seen"] < run["off"]["computed"]
    assert run["served_turns"] >= 4 and run["on"]["copy_ins"] > 0 and run["off"]["copy_ins"] == 0
    assert out["no_reuse_ratio"] > 0 and out["ttft_ratio_p50"] > 0
