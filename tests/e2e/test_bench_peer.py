"""The harness of `lockgate bench throughput --peer vllm` (CI installs no vLLM: the bench
itself is run by hand, `bash scripts/peer-vllm.sh` first). What CI checks: a missing peer
venv is a clear error, the peer's process is bounded in time and its answer is found among
whatever else it prints, the workload's cost is counted, and the report judges equality
with HF and the ratio from the runs it is given."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lockgate.loadtests.bench_peer import PeerUnavailable, _report, peer_python, run_vllm, workload_cost
from lockgate.loadtests.cli import bench_app
from lockgate.loadtests.workload import OfflineRequest
from tests.support.helpers import demo_model


def test_a_missing_peer_venv_names_the_script(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKGATE_PEER_VENV", str(tmp_path / "nowhere"))
    with pytest.raises(PeerUnavailable, match=r"scripts/peer-vllm\.sh"):
        peer_python("vllm")
    with pytest.raises(PeerUnavailable, match="only 'vllm'"):
        peer_python("sglang")
    result = CliRunner().invoke(bench_app, ["throughput", "--peer", "vllm"])
    assert result.exit_code == 2
    assert "scripts/peer-vllm.sh" in result.output


def _fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "python"
    script.write_text("#!/usr/bin/env bash\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_the_peers_answer_is_read_among_its_prints_and_a_hang_is_bounded(tmp_path):
    work = [OfflineRequest([1, 2, 3], 4), OfflineRequest([5, 6], 2)]
    answer = {"elapsed_s": 1.0, "cpu_s": 2.0, "output_tokens": 6, "tokens": [[1, 1, 1, 1], [2, 2]],
              "startup_s": 3.0, "peak_rss_mib": 100.0}
    talker = _fake_python(tmp_path, "cat > \"$0.job\"\necho 'INFO something vLLM says'\n"
                          f"echo 'LOCKGATE-PEER-RESULT {json.dumps(answer)}'\n")
    got = run_vllm(talker, "/some/model", work)
    assert got == answer
    job = json.loads(Path(str(talker) + ".job").read_text())
    assert job["requests"] == [[[1, 2, 3], 4], [[5, 6], 2]] and job["max_model_len"] == 3 + 4 + 16
    silent = _fake_python(tmp_path, "echo 'Traceback: no vllm here' >&2\nexit 3\n")
    with pytest.raises(PeerUnavailable, match=r"exit 3.*no vllm here"):
        run_vllm(silent, "/some/model", work)
    hung = _fake_python(tmp_path, "sleep 30 &\nsleep 30\necho late\n")    # a child holding the pipes too
    with pytest.raises(PeerUnavailable, match="took over 1 s"):
        run_vllm(hung, "/some/model", work, timeout_s=1.0)


def test_the_workload_cost_counts_arithmetic_and_reads():
    d = demo_model("llama")
    one = workload_cost(d, [OfflineRequest(list(range(10)), 5)])
    two = workload_cost(d, [OfflineRequest(list(range(10)), 5)] * 2)
    assert one["flops"] > 0 and one["bytes"] > 0
    assert two["flops"] == pytest.approx(2 * one["flops"])
    longer = workload_cost(d, [OfflineRequest(list(range(10)), 50)])
    assert longer["bytes"] > one["bytes"] and longer["flops"] > one["flops"]


def test_the_report_judges_the_ratio_and_equality_with_hf():
    oracle = [[1, 2], [3, 4]]
    side = {"elapsed_s": 1.0, "cpu_s": 2.0, "output_tokens": 4, "startup_s": 0.5, "peak_rss_mib": 10.0}
    results = {"lockgate": {**side, "tokens": [[1, 2], [3, 4]]},
               "vllm": {**side, "elapsed_s": 2.0, "tokens": [[1, 2], [3, 5]]}}
    lines: list[str] = []
    peaks = {"sgemm_flops": 1e10, "bandwidth_bytes": 1e10}
    report = _report(results, oracle, peaks, {"flops": 5e9, "bytes": 1e9}, lines.append)
    assert report["ratio"] == pytest.approx(2.0)
    assert report["lockgate"]["equal_to_hf"] == 2 and report["vllm"]["equal_to_hf"] == 1
    assert report["both_equal_hf"] is False
    assert report["lockgate"]["sgemm_share"] == pytest.approx(0.5)
    assert report["lockgate"]["roofline_share"] == pytest.approx(0.5)    # bound 0.5 s of 1 s
    assert any("2.00x (target >= 1.2)" in line for line in lines)
    assert any(line.endswith("NO") for line in lines)


def test_neighbours_burn_a_core_each_inside_the_block_and_are_gone_after():
    import psutil

    from lockgate.loadtests.neighbour import Neighbours

    with pytest.raises(ValueError, match="neighbour"):
        Neighbours(-1)
    with Neighbours(1) as n:
        (proc,) = [psutil.Process(p.pid) for p in n.procs]
        proc.cpu_percent(None)
        __import__("time").sleep(0.5)
        assert proc.cpu_percent(None) > 20          # it spins, it does not sleep (a shared machine shares)
    assert not psutil.pid_exists(proc.pid) or proc.status() == psutil.STATUS_ZOMBIE
    with Neighbours(0) as none:
        assert none.procs == []


def test_with_a_neighbour_both_sides_run_beside_it_and_the_engine_also_alone(monkeypatch):
    import lockgate.loadtests.bench_peer as bp

    seen: list[tuple[str, int]] = []
    current = [0]       # burners around the run now

    class Recording(bp.Neighbours):
        def __enter__(self):
            current[0] = self.count
            return self

        def __exit__(self, *exc):
            current[0] = 0

    def engine(fn, *args):
        seen.append(("lockgate", current[0]))
        return {"elapsed_s": 2.0 if current[0] else 1.0, "output_tokens": 100, "threads": 1}

    monkeypatch.setattr(bp, "Neighbours", Recording)
    monkeypatch.setattr(bp, "_in_fresh_process", engine)
    monkeypatch.setattr(bp, "run_vllm", lambda *a: seen.append(("vllm", current[0])) or
                        {"elapsed_s": 2.5, "output_tokens": 100})
    lines: list[str] = []
    results = bp._alternate(Path("/py"), "/m", [], 4, 0, 2, 1, lines.append)
    assert seen == [("lockgate", 1), ("vllm", 1), ("lockgate", 0), ("lockgate", 0), ("vllm", 1), ("lockgate", 1)]
    report = bp._neighbour_report(results, 1, lines.append)
    assert report["of_quiet"] == pytest.approx(0.5) and report["vs_vllm"] == pytest.approx(1.25)
    assert "0.50x of its quiet" in lines[-1] and "1.25x vLLM's" in lines[-1]
