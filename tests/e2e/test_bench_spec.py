"""`lockgate bench spec` at tiny sizes: both sides give the same greedy tokens, the copy-heavy
workload has drafts accepted, and the flood side measures the online TTFT with and without."""

from __future__ import annotations

from lockgate.loadtests.bench_spec import FloodSizes, SpecCase, bench_spec


def test_bench_spec_smoke():
    lines: list[str] = []
    cases = [SpecCase("copy", 1, 2, 24), SpecCase("random", 2, 2, 8)]
    flood = FloodSizes(flood_size=2, flood_prompt=32, flood_output=16, probes=3, probe_interval_s=0.05,
                       probe_output=4, warmup_s=0.1)
    out = bench_spec(cases, repeats=1, flood=flood, fresh_process=False,
                     echo=lambda *a: lines.append(" ".join(map(str, a))))
    copy = out["cases"]["copy-heavy, batch 1"]
    assert all(c["identical"] for c in out["cases"].values())
    assert copy["best"]["off"]["output_tokens"] == copy["best"]["on"]["output_tokens"] == 48
    assert copy["best"]["off"]["draft_tokens"] == 0
    assert 0 < copy["best"]["on"]["accepted_tokens"] <= copy["best"]["on"]["draft_tokens"]
    assert out["flood"]["best"]["on"]["ttft_p99_s"] > 0 and out["flood"]["ttft_p99_ratio"] > 0
    assert any("online TTFT p99 beside an offline flood" in ln for ln in lines)
