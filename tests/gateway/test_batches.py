"""OpenAI's Files and Batch APIs against a live `lockgate serve`, through the official
`openai` client: a batch end to end (embedded, and on PostgreSQL + Redis), malformed lines
as error lines, limits on uploads, isolation between tenants, cancel, a batch paused by its
tenant's budget and resumed when an admin raises it, and durability: the server killed
(SIGKILL) mid-batch and restarted (embedded), and of two replicas on PostgreSQL + Redis the
one holding the batch killed; each time every line is answered once and its usage counted
once."""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import sqlite3
import time

import httpx
import openai
import psycopg
import pytest

from tests.support.gateway_server import GatewayServer, running_server
from tests.support.helpers import demo_model
from tests.support.services import check_redis, drop_redis_prefix, fresh_pg_database

FAST = {"LOCKGATE_BATCH_POLL_S": "0.1", "LOCKGATE_BATCH_LEASE_TTL_S": "2",
        "LOCKGATE_BATCH_PAUSE_POLL_S": "0.3", "LOCKGATE_BATCH_MAX_LINES": "50",
        "LOCKGATE_MAX_FILE_BYTES": "65536"}
FINAL = ("completed", "failed", "expired", "cancelled")


def models() -> dict[str, str]:
    return {"tiny": demo_model("llama", "tiny", 0)}


def client(srv: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


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


def usage_of(db: str, batch_id: str) -> list[tuple]:
    """(request_id, prompt, completion, status) of the usage rows tagged with the batch: `db`
    an SQLite file or a PostgreSQL URL."""
    q = ("SELECT request_id, prompt_tokens, completion_tokens, status FROM usage_records "
         "WHERE batch_id = {p}")
    if db.startswith("postgresql"):
        with psycopg.connect(db.replace("postgresql+asyncpg", "postgresql")) as conn:
            return conn.execute(q.format(p="%s"), (batch_id,)).fetchall()
    with sqlite3.connect(db) as conn:
        return conn.execute(q.format(p="?"), (batch_id,)).fetchall()


def check_answered_once(c: openai.OpenAI, b, n: int, db: str) -> None:
    """Every line answered exactly once, 200 with its completion; one usage row per line,
    each the answer's own usage."""
    out = results(c, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(n))
    assert b.request_counts.completed == n and b.request_counts.failed == 0
    rows = {r[0]: r for r in usage_of(db, b.id)}
    assert len(rows) == n, (len(rows), n)
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        body = r["response"]["body"]
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        row = rows[r["response"]["request_id"]]
        assert (row[1], row[2], row[3]) == (body["usage"]["prompt_tokens"],
                                            body["usage"]["completion_tokens"], "ok")


# -- embedded: the API --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("batches"), "embedded", models=models(),
                        extra_env=FAST) as s:
        yield s


def test_a_batch_runs_end_to_end_with_malformed_lines_as_error_lines(srv):
    tenant, key = srv.tenant()
    c = client(srv, key)
    lines = request_lines(5)
    lines.insert(2, "{not json")
    lines.append(json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "prompt": "x"}}))
    lines.append(json.dumps({"custom_id": "no-model", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}}))
    f = upload(c, lines)
    assert f.purpose == "batch" and f.bytes > 0
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"job": "nightly"})
    assert b.status == "validating" and b.metadata == {"job": "nightly"}
    assert b.request_counts.total == 8
    b = wait_for(c, b.id, lambda b: b.status in FINAL)
    assert b.status == "completed", b
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    assert (b.request_counts.completed, b.request_counts.failed) == (5, 3)
    ok = results(c, b.output_file_id)
    assert sorted(r["custom_id"] for r in ok) == [f"req-{i}" for i in range(5)]
    errs = {r["custom_id"]: r for r in results(c, b.error_file_id)}
    assert errs[None]["error"]["code"] == "invalid_json_line" and "line 3" in errs[None]["error"]["message"]
    assert errs["wrong-url"]["error"]["code"] == "mismatched_endpoint"
    # a line the API refuses is answered as the API would: its status and error body
    assert errs["no-model"]["response"]["status_code"] == 404
    assert errs["no-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    usage = srv.admin.get("/usage", params={"tenant_id": tenant["id"]}).json()["data"][0]
    assert usage["requests"] == 5
    assert usage["completion_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok)
    # the files are listed; output files are the tenant's own too; deleting one hides it
    ids = {x.id for x in c.files.list()}
    assert {f.id, b.output_file_id, b.error_file_id} <= ids
    assert c.files.delete(b.error_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(b.error_file_id)
    assert b.id in {x.id for x in c.batches.list()}


def test_completions_batches_and_pagination(srv):
    _, key = srv.tenant()
    c = client(srv, key)
    made = []
    for _ in range(3):
        f = upload(c, request_lines(2, endpoint="/v1/completions"))
        made.append(c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                     completion_window="24h").id)
    # one page at a time, newest first, none twice
    seen, after = [], None
    while True:
        page = c.batches.list(limit=1, **({"after": after} if after else {}))
        seen += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert seen == made[::-1]
    for batch_id in made:
        b = wait_for(c, batch_id, lambda b: b.status in FINAL)
        assert b.status == "completed" and b.request_counts.completed == 2
        assert all(r["response"]["body"]["object"] == "text_completion"
                   for r in results(c, b.output_file_id))


def test_another_tenants_files_and_batches_are_404_and_admins_see_all(srv):
    _, key_a = srv.tenant()
    _, key_b = srv.tenant()
    a, b = client(srv, key_a), client(srv, key_b)
    f = upload(a, request_lines(1))
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                 lambda: b.files.delete(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in {x.id for x in b.files.list()}
    assert batch.id not in {x.id for x in b.batches.list()}
    # admins list every tenant's; a tenant key is refused there, an admin key on /v1
    listed = srv.admin.get("/batches", params={"limit": 100}).json()["data"]
    assert batch.id in {x["id"] for x in listed}
    assert f.id in {x["id"] for x in srv.admin.get("/files", params={"limit": 100}).json()["data"]}
    assert httpx.get(srv.url + "/admin/v1/batches", headers={"Authorization": f"Bearer {key_a}"}).status_code == 403
    assert httpx.get(srv.url + "/v1/batches", headers={"Authorization": f"Bearer {srv.admin_key}"}).status_code == 403
    wait_for(a, batch.id, lambda x: x.status in FINAL)


def test_uploads_and_batch_bodies_are_checked_with_the_field_named(srv):
    _, key = srv.tenant()
    c = client(srv, key)
    h = {"Authorization": f"Bearer {key}"}
    url = srv.url + "/v1/files"

    def post(**kw) -> httpx.Response:
        return httpx.post(url, headers=h, timeout=30, **kw)

    r = post(json={"purpose": "batch"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
    r = post(data={"purpose": "fine-tune"}, files={"file": ("a.jsonl", b"{}\n")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = post(files={"purpose": (None, "batch")})                  # multipart, no file part
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = post(data={"purpose": "batch"}, files={"file": ("a.jsonl", "\n".join(request_lines(51)).encode())})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file" and "50" in r.json()["error"]["message"]
    r = post(data={"purpose": "batch"}, files={"file": ("a.jsonl", b"\xff\xfe")})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = post(data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 70_000)})
    assert r.status_code == 413 and r.json()["error"]["param"] == "file"
    r = post(data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 300_000)})
    assert r.status_code == 413                                    # refused before it is read
    r = post(data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "10"},
             files={"file": ("a.jsonl", b"{}\n")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after[seconds]"
    f = c.files.create(file=("a.jsonl", io.BytesIO("\n".join(request_lines(1)).encode())), purpose="batch",
                       expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    for body, param in (({"endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
                        ({"endpoint": "/v1/completions", "completion_window": "1h"}, "completion_window"),
                        ({"endpoint": "/v1/completions", "completion_window": "24h", "metadata": [1]}, "metadata"),
                        ({"endpoint": "/v1/completions", "completion_window": "24h", "extra": 1}, "extra")):
        r = httpx.post(srv.url + "/v1/batches", headers=h, json={"input_file_id": f.id, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(srv.url + "/v1/batches", headers=h, json={
        "input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
    # nothing half-made: the refused creations left no batch behind
    assert c.batches.list().data == []
    # a file that has lines but none of them usable still makes a batch: every line an error
    f = upload(c, ["[1]", '{"custom_id": "x"}'])
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_for(c, b.id, lambda x: x.status in FINAL)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (0, 2)


def test_a_cancelled_batch_ends_cancelled_with_what_it_answered(srv):
    _, key = srv.tenant()
    c = client(srv, key)
    f = upload(c, request_lines(40, max_tokens=32))
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = c.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled") and b.cancelling_at
    b = wait_for(c, b.id, lambda x: x.status in FINAL)
    assert b.status == "cancelled" and b.cancelled_at
    counts = b.request_counts
    assert counts.completed + counts.failed == 40 and counts.completed < 40
    errs = results(c, b.error_file_id)
    assert errs and all(e["error"]["code"] == "batch_cancelled" for e in errs)
    # an ended batch cannot be cancelled
    d = c.batches.create(input_file_id=upload(c, request_lines(1)).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    wait_for(c, d.id, lambda x: x.status in FINAL)
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(d.id)


def test_a_batch_pauses_on_its_budget_and_resumes_when_an_admin_raises_it(srv):
    tenant, key = srv.tenant(quota={"daily_token_budget": 60})
    c = client(srv, key)
    f = upload(c, request_lines(6, max_tokens=5))
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait_for(c, b.id, lambda x: getattr(x, "paused", None) is not None)
    assert b.status == "in_progress" and "daily" in b.paused, b.paused
    stuck = b.request_counts.completed
    assert 0 < stuck < 6
    time.sleep(1.5)         # paused means paused: nothing more is answered
    b = c.batches.retrieve(b.id)
    assert b.request_counts.completed == stuck and b.paused
    r = srv.admin.put(f"/tenants/{tenant['id']}/quota", json={"daily_token_budget": 100_000})
    assert r.status_code == 200, r.text
    b = wait_for(c, b.id, lambda x: x.status in FINAL)
    assert b.status == "completed" and b.request_counts.completed == 6 and b.paused is None


# -- durability -----------------------------------------------------------------------------------------
def test_a_server_killed_mid_batch_resumes_it_after_restart_answering_each_line_once(tmp_path):
    admin_key = "lg-" + secrets.token_urlsafe(32)
    env = {**FAST, "LOCKGATE_BATCH_MAX_INFLIGHT": "2"}
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
        check_answered_once(c, b, n, str(tmp_path / "lockgate.db"))
        # the rows written before the kill are the very ones the answers name
        assert {r[0] for r in mid} <= {r["response"]["request_id"] for r in results(c, b.output_file_id)}
    finally:
        srv.stop()


def test_on_services_the_replica_holding_a_batch_killed_the_other_finishes_it(tmp_path):
    redis_url = check_redis()
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    common = dict(redis_url=redis_url, redis_prefix=prefix, pepper=secrets.token_hex(32),
                  admin_key="lg-" + secrets.token_urlsafe(32), models=models(),
                  extra_env={**FAST, "LOCKGATE_BATCH_MAX_INFLIGHT": "2"})
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
                check_answered_once(c_other, b, n, url)
                with psycopg.connect(sync) as conn:
                    owner2 = conn.execute("SELECT lease_owner FROM batches WHERE id = %s", (b.id,)).fetchone()[0]
                assert owner2 is None                  # handed back once done
                assert other.proc.poll() is None
            finally:
                b_srv.stop()
        finally:
            a.stop()
            drop_redis_prefix(prefix)



def test_batch_lines_wait_out_a_full_engine_queue_and_are_never_shed(tmp_path):
    """An engine whose offline queue holds 2 waiting requests (and runs 2 at a time), a
    replica that would put 8 lines in flight: lines the engine refuses are held back and
    retried, so every line is answered 200 and none is an error."""
    kwargs = {"kv_cache_memory": 32 << 20, "max_num_seqs": 2, "max_waiting_per_class": 2}
    env = {**FAST, "LOCKGATE_BATCH_MAX_INFLIGHT": "8", "LOCKGATE_ENGINE_KWARGS": json.dumps(kwargs)}
    with running_server(tmp_path, "embedded", models=models(), extra_env=env) as s:
        _, key = s.tenant()
        c = client(s, key)
        n = 16
        b = c.batches.create(input_file_id=upload(c, request_lines(n, max_tokens=8)).id,
                             endpoint="/v1/chat/completions", completion_window="24h")
        b = wait_for(c, b.id, lambda x: x.status in FINAL)
        assert b.status == "completed"
        check_answered_once(c, b, n, str(tmp_path / "lockgate.db"))
        # the engine did refuse some of them at its bound: the metric counts the refusals
        metrics = httpx.get(s.url + "/metrics", headers={"Authorization": f"Bearer {s.admin_key}"}).text
        refused = [ln for ln in metrics.splitlines()
                   if ln.startswith("lockgate_overload_refusals_total{") and 'reason="refused"' in ln]
        assert refused and sum(float(ln.rsplit(" ", 1)[1]) for ln in refused) > 0, refused
