"""Batches outlive the process that ran them, on real `lockgate serve` processes (a kill is
what is tested): the server killed (SIGKILL) mid-batch and restarted (embedded), and of two
replicas on PostgreSQL + Redis the one holding the batch killed; each time every line is
answered once and its usage counted once. (The Batch API's routes: test_batches.py.)"""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import time

import openai
import psycopg

from tests.support.batch_lines import FINAL, check_answered_once, fast_env, request_lines, usage_of
from tests.support.gateway_server import GatewayServer
from tests.support.helpers import demo_model
from tests.support.services import check_redis, drop_redis_prefix, fresh_pg_database


def models() -> dict[str, str]:
    return {"tiny": demo_model("llama", "tiny", 0)}


def client(srv: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


def upload(c: openai.OpenAI, lines: list[str], **kw):
    return c.files.create(file=("input.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())),
                          purpose="batch", **kw)


def wait_for(c: openai.OpenAI, batch_id: str, until, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        b = c.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch did not get there in {timeout} s: {b}"
        time.sleep(0.2)


def results(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(ln) for ln in c.files.content(file_id).text.splitlines() if ln.strip()]


# -- durability -----------------------------------------------------------------------------------------
def test_a_server_killed_mid_batch_resumes_it_after_restart_answering_each_line_once(tmp_path):
    admin_key = "lg-" + secrets.token_urlsafe(32)
    env = fast_env(batch_max_inflight=2)
    srv = GatewayServer.start(tmp_path, models=models(), admin_key=admin_key, extra_env=env)
    n = 24
    try:
        _, key = srv.tenant()
        c = client(srv, key)
        b = c.batches.create(input_file_id=upload(c, request_lines(n, max_tokens=24)).id,
                             endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(c, b.id, lambda x: x.request_counts.completed >= 4)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    finally:
        srv.stop()
    mid = usage_of(str(tmp_path / "lockgate.db"), b.id)
    assert 4 <= len(mid) < n, len(mid)
    srv = GatewayServer.start(tmp_path, models=models(), admin_key=admin_key, extra_env=env)
    try:
        c = client(srv, key)
        b = wait_for(c, b.id, lambda x: x.status in FINAL)
        assert b.status == "completed"
        check_answered_once(results(c, b.output_file_id), b, n, usage_of(str(tmp_path / "lockgate.db"), b.id))
        # the rows written before the kill are the very ones the answers name
        assert {r[0] for r in mid} <= {r["response"]["request_id"] for r in results(c, b.output_file_id)}
    finally:
        srv.stop()


def test_on_services_the_replica_holding_a_batch_killed_the_other_finishes_it(tmp_path):
    redis_url = check_redis()
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    common = dict(redis_url=redis_url, redis_prefix=prefix, pepper=secrets.token_hex(32),
                  admin_key="lg-" + secrets.token_urlsafe(32), models=models(),
                  extra_env=fast_env(batch_max_inflight=2))
    n = 24
    with fresh_pg_database() as url:
        a = GatewayServer.start(tmp_path / "a", database_url=url, **common)
        try:
            b_srv = GatewayServer.start(tmp_path / "b", database_url=url, **common)
            try:
                _, key = a.tenant()
                ca, cb = client(a, key), client(b_srv, key)
                b = ca.batches.create(input_file_id=upload(ca, request_lines(n, max_tokens=24)).id,
                                      endpoint="/v1/chat/completions", completion_window="24h")
                wait_for(ca, b.id, lambda x: x.request_counts.completed >= 4)
                sync = url.replace("postgresql+asyncpg", "postgresql")
                with psycopg.connect(sync) as conn:
                    owner = conn.execute("SELECT lease_owner FROM batches WHERE id = %s", (b.id,)).fetchone()[0]
                holder, other, c_other = ((a, b_srv, cb) if owner.split(":")[1] == str(a.proc.pid)
                                          else (b_srv, a, ca))
                holder.proc.send_signal(signal.SIGKILL)
                holder.proc.wait(30)
                b = wait_for(c_other, b.id, lambda x: x.status in FINAL)
                assert b.status == "completed"
                check_answered_once(results(c_other, b.output_file_id), b, n, usage_of(url, b.id))
                with psycopg.connect(sync) as conn:
                    owner2 = conn.execute("SELECT lease_owner FROM batches WHERE id = %s", (b.id,)).fetchone()[0]
                assert owner2 is None                  # handed back once done
                assert other.proc.poll() is None
            finally:
                b_srv.stop()
        finally:
            a.stop()
            drop_redis_prefix(prefix)
