"""`lockgate bench structured` at a tiny size on the tiny model, in this process: both sides
emit the same tokens' count, the constrained side's outputs follow the schema's start, and
the report carries the ratio (its value, a timing, is not asserted)."""

from __future__ import annotations

import json

from lockgate.loadtests.bench_structured import StructuredSizes, bench_structured
from tests.support.helpers import demo_model


def test_bench_structured_runs_both_sides(tmp_path):
    sizes = StructuredSizes(num_requests=4, prompt=(8, 16), output_len=12, repeats=1)
    out = bench_structured(demo_model("llama", "tiny", 0), sizes=sizes, fresh_process=False,
                           echo=lambda *_: None, json_out=str(tmp_path / "s.json"))
    free, held = out["results"]["free"], out["results"]["half constrained"]
    assert free["output_tokens"] == held["output_tokens"] == 4 * 12
    assert held["sample_text"].startswith('[{"id":')
    assert out["ratio"] > 0 and "half_constrained_0_8x_of_free" in out["targets"]
    assert json.loads((tmp_path / "s.json").read_text())["sizes"]["num_requests"] == 4
