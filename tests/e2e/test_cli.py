"""The `lockgate` command line, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.helpers import demo_model

LOCKGATE = str(Path(sys.executable).with_name("lockgate"))


def run(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([LOCKGATE, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_demo_model_command_writes_a_loadable_model(tmp_path):
    out = run("demo-model", str(tmp_path / "m"), "--family", "mistral", "--seed", "3")
    assert out.returncode == 0, out.stderr
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["MistralForCausalLM"]
    from lockgate.engine import LLM, SamplingParams

    res = LLM(str(tmp_path / "m")).generate("hello", SamplingParams(max_tokens=3), use_progress_bar=False)
    assert len(res[0].outputs[0].token_ids) >= 1


def test_demo_model_command_rejects_bad_family(tmp_path):
    out = run("demo-model", str(tmp_path / "m"), "--family", "gpt9")
    assert out.returncode != 0
    assert "family" in (out.stderr + out.stdout)


def test_bench_throughput_runs_all_three_sides_and_prints_ratios(tmp_path):
    """A 4-request run on the tiny model: checks the harness, not the speed."""
    report = tmp_path / "bench.json"
    out = run("bench", "throughput", "--model", demo_model("llama"), "--num-requests", "4", "--repeats", "1",
              "--json", str(report))
    assert out.returncode == 0, out.stderr[-3000:]
    for line in ("ratio engine / HF static batching", "ratio engine / ideal batching",
                 "KV utilization", "start-up", "peak RSS", "step time split"):
        assert line in out.stdout
    data = json.loads(report.read_text())
    assert data["match_ideal"] == 4
    assert set(data["tokens_per_s"]) == {"engine", "ideal", "hf_static"}
    assert 0 < data["kv_utilization"] <= 1


def test_bench_throughput_runs_a_baseline_revision_from_its_own_tree(tmp_path, monkeypatch):
    """`--baseline REV`: the revision's tree unpacked under the cache directory, its engine
    run in an interpreter of its own that imports that tree (checked by the bench), its
    greedy tokens compared; a name that is no revision is refused before anything runs."""
    from lockgate.loadtests.bench_throughput import baseline_tree, bench_throughput

    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path / "cache"))
    lines: list[str] = []
    report = bench_throughput(demo_model("llama"), num_requests=2, repeats=1, skip_hf=True, skip_ideal=True,
                              baseline="HEAD", echo=lines.append)
    assert report["match_baseline"] == 2 and report["engine_vs_baseline"] > 0, lines
    assert any(line.startswith("ratio engine / engine at HEAD") for line in lines)
    assert (baseline_tree("HEAD") / "lockgate" / "__init__.py").is_file()
    with pytest.raises(ValueError, match="not a revision"):
        baseline_tree("no-such-revision")
