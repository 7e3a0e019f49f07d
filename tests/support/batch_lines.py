"""The Batch API tests' shared parts (tests/gateway/test_batches.py in process,
test_batch_durability.py on `lockgate serve` processes): request lines, fast batch settings,
the usage rows a batch wrote, and the check that every line was answered exactly once."""

from __future__ import annotations

import json
import sqlite3

# polled every 0.1 s, leases of 2 s, 50 lines and 64 KiB a file at most
FAST = {"batch_poll_s": 0.1, "batch_lease_ttl_s": 2.0, "batch_pause_poll_s": 0.3, "batch_max_lines": 50,
        "max_file_bytes": 65536}
FINAL = ("completed", "failed", "expired", "cancelled")


def fast_env(**more: object) -> dict[str, str]:
    """FAST (and `more`) as a `lockgate serve` environment."""
    return {f"LOCKGATE_{k.upper()}": str(v) for k, v in {**FAST, **more}.items()}


def request_lines(n: int, max_tokens: int = 4, endpoint: str = "/v1/chat/completions") -> list[str]:
    out = []
    for i in range(n):
        body: dict = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0}
        if endpoint == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": f"line {i}: say something"}]
        else:
            body["prompt"] = f"line {i}: once upon a time"
        out.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body}))
    return out


def usage_of(db: str, batch_id: str) -> list[tuple]:
    """(request_id, prompt, completion, status) of the usage rows tagged with the batch: `db`
    an SQLite file or a PostgreSQL URL."""
    q = ("SELECT request_id, prompt_tokens, completion_tokens, status FROM usage_records "
         "WHERE batch_id = {p}")
    if db.startswith("postgresql"):
        import psycopg

        with psycopg.connect(db.replace("postgresql+asyncpg", "postgresql")) as conn:
            return conn.execute(q.format(p="%s"), (batch_id,)).fetchall()
    with sqlite3.connect(db) as conn:
        return conn.execute(q.format(p="?"), (batch_id,)).fetchall()


def check_answered_once(out: list[dict], b, n: int, rows: list[tuple]) -> None:
    """Every line answered exactly once (`out`: the output file's lines), 200 with its
    completion; one usage row per line (`rows`: usage_of's), each the answer's own usage."""
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(n))
    assert b.request_counts.completed == n and b.request_counts.failed == 0
    by_id = {r[0]: r for r in rows}
    assert len(by_id) == n, (len(by_id), n)
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        body = r["response"]["body"]
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        row = by_id[r["response"]["request_id"]]
        assert (row[1], row[2], row[3]) == (body["usage"]["prompt_tokens"],
                                            body["usage"]["completion_tokens"], "ok")
