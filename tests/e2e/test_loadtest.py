"""`lockgate loadtest` against a live `lockgate serve` on loopback, 20 seconds of every class
of user (online chat, offline, batch submitters through the Batch API, misbehaving users),
and what it wrote: every class served, no unexpected failure, the usage report billing
exactly the tokens the clients received, Jain's index, the plots, locust's CSVs and report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model

REPO = Path(__file__).resolve().parents[2]
LOCKGATE = str(Path(sys.executable).with_name("lockgate"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_loadtest_smoke_writes_verdicts_plots_and_reports(tmp_path):
    out = tmp_path / "out"
    with running_server(tmp_path / "server", "embedded", models={"tiny": demo_model("llama", "tiny", 0)}) as server:
        env = {**os.environ, "LOCKGATE_ADMIN_KEY": server.admin_key}
        run = subprocess.run(
            [LOCKGATE, "loadtest", "--url", server.url, "--users", "8",
             "--duration", "20", "--mix", "online=0.5,offline=0.2,batch=0.1,bad=0.2",
             "--max-tokens", "16", "--stop-timeout", "15", "--out", str(out)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert "served:" in run.stderr                              # the progress line
    summary = json.loads((out / "summary.json").read_text())

    classes = summary["classes"]
    assert set(classes) == {"online", "offline", "batch", "bad"}
    for name, c in classes.items():
        assert c["ok"] + c["expected"] > 0, (name, c)
    assert classes["bad"]["expected"] > 0                       # refusals as expected, not failures
    assert summary["unexpected_failures"] == 0, summary["failure_examples"]
    assert summary["accounting"]["error_tokens"] == 0, summary["accounting"]
    billed = summary["accounting"]["tenants"]
    assert sum(t["billed"]["completion_tokens"] for t in billed.values()) > 0
    assert classes["online"]["ttft_ms"]["p99"] is not None
    assert 0.0 <= summary["fairness"]["online"]["jain"] <= 1.0
    # online TTFT is reported for the requests sent while batch jobs were in flight
    beside = summary["online_beside_batches"]
    assert beside["batch_jobs"] >= 1 and beside["during"]["n"] >= 1 and beside["during"]["p99"] > 0, beside
    for t in summary["tenants"]:                               # each user called as its tenant
        assert t["users_seen"] == t["users"], t
    assert summary["passed"] and all(v["passed"] for v in summary["verdicts"] if v["hard"])

    for name in ("ttft.png", "throughput.png", "errors.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name
    assert "online" in (out / "summary.md").read_text()
    stats = (out / "locust_stats.csv").read_text()
    assert "TTFT,online chat" in stats and "ITL,online chat" in stats and "batch create" in stats
    assert (out / "locust.html").stat().st_size > 10_000
