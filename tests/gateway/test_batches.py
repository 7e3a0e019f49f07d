"""OpenAI's Files and Batch APIs against the gateway in process (the fake engine, embedded),
through the official `openai` client: a batch end to end, malformed lines as error lines,
limits on uploads, isolation between tenants, cancel, a batch paused by its tenant's budget
and resumed when an admin raises it, and batch lines that wait out a full engine queue. (A
server killed mid-batch, and a replica holding one: test_batch_durability.py.)"""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import openai
import pytest
import pytest_asyncio

from tests.support.batch_lines import FAST, FINAL, check_answered_once, request_lines, usage_of
from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


def models() -> dict[str, str]:
    return {"tiny": demo_model("llama", "tiny", 0)}


def client(srv, key: str) -> openai.AsyncOpenAI:
    return srv.openai(key, timeout=30)


async def upload(c: openai.AsyncOpenAI, lines: list[str], **kw):
    return await c.files.create(file=("input.jsonl", io.BytesIO(("\n".join(lines) + "\n").encode())),
                                purpose="batch", **kw)


async def wait_for(c: openai.AsyncOpenAI, batch_id: str, until, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        b = await c.batches.retrieve(batch_id)
        if until(b):
            return b
        assert time.monotonic() < deadline, f"batch did not get there in {timeout} s: {b}"
        await asyncio.sleep(0.2)


async def results(c: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(ln) for ln in (await c.files.content(file_id)).text.splitlines() if ln.strip()]


# -- the API -------------------------------------------------------------------------------------------
@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def srv(tmp_path_factory):
    async with running_gateway(tmp_path_factory.mktemp("batches"), models=models(), **FAST) as gw:
        yield gw


async def test_a_batch_runs_end_to_end_with_malformed_lines_as_error_lines(srv):
    tenant, key = await srv.tenant()
    c = client(srv, key)
    lines = request_lines(5)
    lines.insert(2, "{not json")
    lines.append(json.dumps({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "prompt": "x"}}))
    lines.append(json.dumps({"custom_id": "no-model", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}}))
    f = await upload(c, lines)
    assert f.purpose == "batch" and f.bytes > 0
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "nightly"})
    assert b.status == "validating" and b.metadata == {"job": "nightly"}
    assert b.request_counts.total == 8
    b = await wait_for(c, b.id, lambda b: b.status in FINAL)
    assert b.status == "completed", b
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    assert (b.request_counts.completed, b.request_counts.failed) == (5, 3)
    ok = await results(c, b.output_file_id)
    assert sorted(r["custom_id"] for r in ok) == [f"req-{i}" for i in range(5)]
    errs = {r["custom_id"]: r for r in await results(c, b.error_file_id)}
    assert errs[None]["error"]["code"] == "invalid_json_line" and "line 3" in errs[None]["error"]["message"]
    assert errs["wrong-url"]["error"]["code"] == "mismatched_endpoint"
    # a line the API refuses is answered as the API would: its status and error body
    assert errs["no-model"]["response"]["status_code"] == 404
    assert errs["no-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    usage = (await srv.admin.get("/usage", params={"tenant_id": tenant["id"]})).json()["data"][0]
    assert usage["requests"] == 5
    assert usage["completion_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"] for r in ok)
    # the files are listed; output files are the tenant's own too; deleting one hides it
    ids = {x.id async for x in c.files.list()}
    assert {f.id, b.output_file_id, b.error_file_id} <= ids
    assert (await c.files.delete(b.error_file_id)).deleted
    with pytest.raises(openai.NotFoundError):
        await c.files.retrieve(b.error_file_id)
    assert b.id in {x.id async for x in c.batches.list()}


async def test_completions_batches_and_pagination(srv):
    _, key = await srv.tenant()
    c = client(srv, key)
    made = []
    for _ in range(3):
        f = await upload(c, request_lines(2, endpoint="/v1/completions"))
        made.append((await c.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                            completion_window="24h")).id)
    # one page at a time, newest first, none twice
    seen, after = [], None
    while True:
        page = await c.batches.list(limit=1, **({"after": after} if after else {}))
        seen += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert seen == made[::-1]
    for batch_id in made:
        b = await wait_for(c, batch_id, lambda b: b.status in FINAL)
        assert b.status == "completed" and b.request_counts.completed == 2
        assert all(r["response"]["body"]["object"] == "text_completion"
                   for r in await results(c, b.output_file_id))


async def test_another_tenants_files_and_batches_are_404_and_admins_see_all(srv):
    _, key_a = await srv.tenant()
    _, key_b = await srv.tenant()
    a, b = client(srv, key_a), client(srv, key_b)
    f = await upload(a, request_lines(1))
    batch = await a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id),
                 lambda: b.files.delete(f.id), lambda: b.batches.retrieve(batch.id),
                 lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call()
    assert f.id not in {x.id async for x in b.files.list()}
    assert batch.id not in {x.id async for x in b.batches.list()}
    # admins list every tenant's; a tenant key is refused there, an admin key on /v1
    listed = (await srv.admin.get("/batches", params={"limit": 100})).json()["data"]
    assert batch.id in {x["id"] for x in listed}
    assert f.id in {x["id"] for x in (await srv.admin.get("/files", params={"limit": 100})).json()["data"]}
    assert (await srv.http.get("/admin/v1/batches", headers=srv.auth(key_a))).status_code == 403
    assert (await srv.http.get("/v1/batches", headers=srv.auth(srv.admin_key))).status_code == 403
    await wait_for(a, batch.id, lambda x: x.status in FINAL)


async def test_uploads_and_batch_bodies_are_checked_with_the_field_named(srv):
    _, key = await srv.tenant()
    c = client(srv, key)
    h = {"Authorization": f"Bearer {key}"}
    url = "/v1/files"

    async def post(**kw) -> httpx.Response:
        return await srv.http.post(url, headers=h, timeout=30, **kw)

    r = await post(json={"purpose": "batch"})
    assert r.status_code == 415 and r.json()["error"]["param"] == "content-type"
    r = await post(data={"purpose": "fine-tune"}, files={"file": ("a.jsonl", b"{}\n")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = await post(files={"purpose": (None, "batch")})                  # multipart, no file part
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = await post(data={"purpose": "batch"}, files={"file": ("a.jsonl", "\n".join(request_lines(51)).encode())})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file" and "50" in r.json()["error"]["message"]
    r = await post(data={"purpose": "batch"}, files={"file": ("a.jsonl", b"\xff\xfe")})
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = await post(data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 70_000)})
    assert r.status_code == 413 and r.json()["error"]["param"] == "file"
    r = await post(data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 300_000)})
    assert r.status_code == 413                                    # refused before it is read
    r = await post(data={"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "10"},
                   files={"file": ("a.jsonl", b"{}\n")})
    assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after[seconds]"
    f = await c.files.create(file=("a.jsonl", io.BytesIO("\n".join(request_lines(1)).encode())), purpose="batch",
                             expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at == f.created_at + 3600
    for body, param in (({"endpoint": "/v1/embeddings", "completion_window": "24h"}, "endpoint"),
                        ({"endpoint": "/v1/completions", "completion_window": "1h"}, "completion_window"),
                        ({"endpoint": "/v1/completions", "completion_window": "24h", "metadata": [1]}, "metadata"),
                        ({"endpoint": "/v1/completions", "completion_window": "24h", "extra": 1}, "extra")):
        r = await srv.http.post("/v1/batches", headers=h, json={"input_file_id": f.id, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = await srv.http.post("/v1/batches", headers=h, json={
        "input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "input_file_id"
    # nothing half-made: the refused creations left no batch behind
    assert (await c.batches.list()).data == []
    # a file that has lines but none of them usable still makes a batch: every line an error
    f = await upload(c, ["[1]", '{"custom_id": "x"}'])
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = await wait_for(c, b.id, lambda x: x.status in FINAL)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (0, 2)


async def test_a_cancelled_batch_ends_cancelled_with_what_it_answered(srv):
    _, key = await srv.tenant()
    c = client(srv, key)
    f = await upload(c, request_lines(40, max_tokens=32))
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = await c.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled") and b.cancelling_at
    b = await wait_for(c, b.id, lambda x: x.status in FINAL)
    assert b.status == "cancelled" and b.cancelled_at
    counts = b.request_counts
    assert counts.completed + counts.failed == 40 and counts.completed < 40
    errs = await results(c, b.error_file_id)
    assert errs and all(e["error"]["code"] == "batch_cancelled" for e in errs)
    # an ended batch cannot be cancelled
    d = await c.batches.create(input_file_id=(await upload(c, request_lines(1))).id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    await wait_for(c, d.id, lambda x: x.status in FINAL)
    with pytest.raises(openai.ConflictError):
        await c.batches.cancel(d.id)


async def test_a_batch_pauses_on_its_budget_and_resumes_when_an_admin_raises_it(srv):
    tenant, key = await srv.tenant(quota={"daily_token_budget": 60})
    c = client(srv, key)
    f = await upload(c, request_lines(6, max_tokens=5))
    b = await c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = await wait_for(c, b.id, lambda x: getattr(x, "paused", None) is not None)
    assert b.status == "in_progress" and "daily" in b.paused, b.paused
    stuck = b.request_counts.completed
    assert 0 < stuck < 6
    await asyncio.sleep(1.5)         # paused means paused: nothing more is answered
    b = await c.batches.retrieve(b.id)
    assert b.request_counts.completed == stuck and b.paused
    r = await srv.admin.put(f"/tenants/{tenant['id']}/quota", json={"daily_token_budget": 100_000})
    assert r.status_code == 200, r.text
    b = await wait_for(c, b.id, lambda x: x.status in FINAL)
    assert b.status == "completed" and b.request_counts.completed == 6 and b.paused is None


# -- a full engine ------------------------------------------------------------------------------------
async def test_batch_lines_wait_out_a_full_engine_queue_and_are_never_shed(tmp_path):
    """An engine that takes 2 requests at a time (each 8 tokens, 10 ms apart) and refuses more
    (EngineOverloaded), a gateway that would put 8 lines in flight: lines the engine refuses
    are held back and retried, so every line is answered 200 and none is an error."""
    async with running_gateway(tmp_path, models=models(), engine_kwargs={"max_waiting": 2, "token_interval_s": 0.01},
                               **{**FAST, "batch_max_inflight": 8}) as s:
        _, key = await s.tenant()
        c = client(s, key)
        n = 16
        b = await c.batches.create(input_file_id=(await upload(c, request_lines(n, max_tokens=8))).id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
        b = await wait_for(c, b.id, lambda x: x.status in FINAL)
        assert b.status == "completed"
        check_answered_once(await results(c, b.output_file_id), b, n,
                            usage_of(str(tmp_path / "lockgate.db"), b.id))
        assert s.engine.num_refused > 0
        # the engine did refuse some of them at its bound: the metric counts the refusals
        metrics = (await s.admin.get(s.url + "/metrics")).text
        refused = [ln for ln in metrics.splitlines()
                   if ln.startswith("lockgate_overload_refusals_total{") and 'reason="refused"' in ln]
        assert refused and sum(float(ln.rsplit(" ", 1)[1]) for ln in refused) > 0, refused
