"""`lockgate bench tp` at tiny sizes on the tiny model: both sides run, give the forced
tokens and the same greedy tokens, and only the two-rank side spends time in collectives."""

from __future__ import annotations

from lockgate.loadtests.bench_tp import TpCase, bench_tp
from tests.support.helpers import demo_model


def test_bench_tp_smoke():
    lines: list[str] = []
    case = TpCase("tiny", demo_model("llama", "tiny", 0), num_requests=3, prompt_len=20, output_len=4)
    out = bench_tp([case], repeats=1, fresh_process=False, echo=lambda *a: lines.append(" ".join(map(str, a))))
    one, two = out["cases"]["tiny"]["best"]["1"], out["cases"]["tiny"]["best"]["2"]
    assert one["output_tokens"] == two["output_tokens"] == 12
    assert one["first_tokens"] == two["first_tokens"]
    assert one["collective_s"] == 0.0 < two["collective_s"] and 0 < two["collective_share"] < 1
    assert out["cases"]["tiny"]["ratio"] > 0 and any("N=2 / N=1" in ln for ln in lines)
