"""`lockgate bench serve --peer vllm`'s workload and report (the servers themselves run in the
bench, not here: each side's start-up costs tens of seconds)."""

from __future__ import annotations

from lockgate.loadtests.bench_serve_peer import PeerServeSizes, _report, workload
from tests.support.helpers import demo_model, special_ids


def test_the_workload_is_random_tokens_of_the_asked_length_without_special_ones():
    d = demo_model("llama")
    s = PeerServeSizes(num_prompts=5, input_len=12)
    prompts = workload(d, s)
    assert [len(p) for p in prompts] == [12] * 5
    assert not set().union(*prompts) & special_ids(d)
    assert workload(d, s) == prompts and len({tuple(p) for p in prompts}) == 5


def _m(tok_s: float, p99: float) -> dict:
    return {"completed": 10, "failed": 0, "output_tok_s": tok_s, "tpot_ms_p50": p99 / 2, "tpot_ms_p99": p99,
            "ttft_ms_mean": 1.0, "ttft_ms_p99": 2.0}


def test_the_report_takes_each_sides_best_run_and_prints_the_ratios():
    s = PeerServeSizes(repeats=2)
    runs = {"engine-process": [{"inf": _m(900, 10), "c16": _m(500, 5)}, {"inf": _m(1200, 12), "c16": _m(400, 4)}],
            "in-process": [{"inf": _m(1000, 11), "c16": _m(500, 5)},
                                    {"inf": _m(600, 9), "c16": _m(250, 2)}],
            "vllm": [{"inf": {"completed": 0, "failed": 10}, "c16": _m(1000, 3)},
                     {"inf": _m(800, 20), "c16": _m(100, 1)}]}
    lines: list[str] = []
    report = _report(runs, s, lines.append)
    assert report["ratios"]["engine-process/in-process"]["inf"] == 1.2
    ratios = report["ratios"]["engine-process/vllm"]
    assert ratios["inf"] == 1.5 and ratios["inf_tpot_p99"] == 12 / 20 and ratios["c16"] == 0.5
    assert report["ratios"]["in-process/vllm"]["inf"] == 1000 / 800
    assert any("engine-process / vllm at inf: 1.50x" in line for line in lines)
