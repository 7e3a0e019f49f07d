"""The locust suite (loadtests/locustfile.py) against a live `lockgate serve` on loopback:
a few users for a few seconds, each stopping after a bounded number of requests; every
answer must be what the suite accepts (a 200 with a well-formed body or stream, or a 429
counted under its own name)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.gateway_server import running_server
from tests.support.helpers import demo_model

REPO = Path(__file__).resolve().parents[2]


def test_locust_suite_runs_clean_and_counts_refusals(tmp_path):
    models = {"tiny": demo_model("llama", "tiny", 0)}
    with running_server(tmp_path, "embedded", models=models) as server:
        # 4 users x 12 requests each against 30 a minute: some are refused (429)
        _, key = server.tenant(quota={"requests_per_minute": 30})
        env = {**os.environ, "LOCKGATE_KEY": key, "LOCKGATE_MAX_TOKENS": "4",
               "LOCKGATE_REQUESTS_PER_USER": "12"}
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtests/locustfile.py", "--headless",
             "-u", "4", "-r", "4", "-t", "90s", "--host", server.url, "--json"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr[-3000:]
    stats = {(s["method"], s["name"]): s for s in json.loads(run.stdout)}
    failed = {k: s["num_failures"] for k, s in stats.items() if s["num_failures"]}
    assert not failed, (failed, run.stderr[-3000:])
    answered = {name for (method, name), s in stats.items() if s["num_requests"]}
    assert "/v1/models" in answered
    # successes of both shapes, and the refusals counted apart from them
    assert any(n in answered for n in ("chat (online)", "completion (online)")), answered
    assert any(n.endswith("(429)") for n in answered), answered
    posts = {name: s["num_requests"] for (method, name), s in stats.items() if method == "POST"}
    assert sum(posts.values()) == 4 * 12, posts    # each user its budget, then the run ended
    admitted = sum(n for name, n in posts.items() if not name.endswith("(429)"))
    assert 0 < admitted <= 30, posts               # the key's 30 a minute held
