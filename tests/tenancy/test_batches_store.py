"""The Batch API's rows (tenancy/batches.py) on SQLite and PostgreSQL: input lines parsed with
malformed ones kept as errors, a line answered and its usage row written once only, leases
claimed by one owner at a time and taken over once lapsed, files swept when their time is up."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from sqlalchemy import func, select

from lockgate.tenancy import batches as store
from lockgate.tenancy import tenants
from lockgate.tenancy.errors import Invalid, NotFound
from lockgate.tenancy.models import StoredFile, UsageRecord, utcnow
from lockgate.tenancy.usage.writer import UsageRow

ACTOR = "key_0000000000000000"
CHAT = "/v1/chat/completions"


def line(cid: str, url: str = CHAT, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"model": "m", "messages": [], **body}})


def test_input_lines_keep_malformed_ones_as_errors_and_refuse_unreadable_files():
    text = "\n".join([line("a"), "{oops", "[1]", json.dumps({"custom_id": 5}), line("a"),
                      line("b", url="/v1/completions"), line("c", stream=True),
                      json.dumps({"custom_id": "d", "method": "GET", "url": CHAT, "body": {}}), "", line("e")])
    got = store.parse_input(text.encode(), endpoint=CHAT, max_lines=20)
    assert [g.line for g in got] == [*range(8), 9]        # numbered by place; blank lines are not lines
    errors = [(g.custom_id, g.error["code"]) if g.error else (g.custom_id, None) for g in got]
    assert errors == [("a", None), (None, "invalid_json_line"), (None, "invalid_request"),
                      (None, "invalid_request"), ("a", "duplicate_custom_id"), ("b", "mismatched_endpoint"),
                      ("c", "invalid_request"), ("d", "invalid_request"), ("e", None)]
    assert got[0].body == {"model": "m", "messages": []}
    # a JSON string may hold U+2028 and U+0085 unescaped: still one line
    odd = json.dumps({"custom_id": "u", "method": "POST", "url": CHAT,
                      "body": {"model": "m", "messages": [{"role": "user", "content": "a\u2028b\x85c"}]}},
                     ensure_ascii=False)
    (only,) = store.parse_input((odd + "\r\n").encode(), endpoint=CHAT, max_lines=1)
    assert only.error is None and only.body["messages"][0]["content"] == "a\u2028b\x85c"
    for content, why in ((b"\xff", "UTF-8"), (b"\n \n", "no lines"), ((line("x") + "\n") .encode() * 3, "at most 2")):
        with pytest.raises(Invalid, match=why):
            store.parse_input(content, endpoint=CHAT, max_lines=2)


async def make_batch(sessions, n: int = 3, content: bytes | None = None):
    async with sessions() as s:
        t = await tenants.create_tenant(s, name="acme", actor=ACTOR)
    async with sessions() as s:
        f = await store.create_file(s, tenant_id=t.id, purpose="batch", filename="in.jsonl",
                                    content=content or "\n".join(line(f"r{i}") for i in range(n)).encode())
    async with sessions() as s:
        b = await store.create_batch(s, tenant_id=t.id, api_key_id="key_x", input_file_id=f.id,
                                     endpoint=CHAT, completion_window="24h", max_lines=100)
    return t, f, b


def usage(batch_id: str, rid: str, tenant_id: str) -> dict:
    return UsageRow(request_id=rid, tenant_id=tenant_id, api_key_id="key_x", model="m", service_tier="flex",
                    prompt_tokens=3, cached_tokens=0, completion_tokens=2, status="ok", queue_ms=1.0,
                    ttft_ms=1.0, total_ms=2.0, batch_id=batch_id).values()


async def test_a_line_is_answered_and_counted_once_whoever_answers_it_again(sessions):
    t, _, b = await make_batch(sessions)
    assert b.status == "validating" and b.total == 3
    async with sessions() as s:
        first = await store.finish_line(s, batch_id=b.id, line=1, status="done", status_code=200,
                                        response={"x": 1}, error=None, request_id="r-1",
                                        usage=usage(b.id, "r-1", t.id))
    async with sessions() as s:     # a second run of the same line (another replica): nothing written
        second = await store.finish_line(s, batch_id=b.id, line=1, status="done", status_code=200,
                                         response={"x": 2}, error=None, request_id="r-1b",
                                         usage=usage(b.id, "r-1b", t.id))
    assert (first, second) == (True, False)
    async with sessions() as s:
        rows = (await s.execute(select(UsageRecord.request_id).where(UsageRecord.batch_id == b.id))).scalars().all()
        assert rows == ["r-1"]
        assert (await store.line_counts(s, [b.id]))[b.id] == {"completed": 1, "failed": 0}
        assert [ln.line for ln in await store.pending_lines(s, batch_id=b.id, limit=10, skip={0})] == [2]


async def test_a_lease_is_held_by_one_owner_and_taken_over_once_it_lapses(sessions):
    _, _, b = await make_batch(sessions)
    async with sessions() as s:
        assert await store.claim_batches(s, owner="A", ttl_s=30, limit=5) == [b.id]
    async with sessions() as s:
        assert await store.claim_batches(s, owner="B", ttl_s=30, limit=5) == []
        assert await store.renew_lease(s, batch_id=b.id, owner="A", ttl_s=0.001)
        assert not await store.renew_lease(s, batch_id=b.id, owner="B", ttl_s=30)
    async with sessions() as s:       # A's lease lapsed: B takes the batch, A can no longer renew it
        assert await store.claim_batches(s, owner="B", ttl_s=30, limit=5) == [b.id]
        assert not await store.renew_lease(s, batch_id=b.id, owner="A", ttl_s=30)
        assert not await store.set_status(s, batch_id=b.id, owner="A", status="in_progress")
        assert await store.set_status(s, batch_id=b.id, owner="B", status="in_progress")
    async with sessions() as s:       # the results are written by the holder only, then the lease freed
        for n in range(3):
            await store.finish_line(s, batch_id=b.id, line=n, status="error", status_code=400,
                                    response=None, error={"code": "x"}, request_id=None, usage=None)
        batch = await store.get_batch(s, batch_id=b.id, tenant_id=None)
        assert not await store.write_results(s, batch=batch, owner="A", final_status="completed")
        assert await store.write_results(s, batch=batch, owner="B", final_status="completed")
        batch = await store.get_batch(s, batch_id=b.id, tenant_id=None)
        assert batch.status == "completed" and batch.lease_owner is None and batch.output_file_id is None
        err = await store.get_file(s, file_id=batch.error_file_id, tenant_id=batch.tenant_id)
        content = await store.file_bytes(s, err.id)
        assert [json.loads(x)["custom_id"] for x in content.decode().splitlines()] == ["r0", "r1", "r2"]
        assert await store.claim_batches(s, owner="C", ttl_s=30, limit=5) == []    # ended: nobody claims it


async def test_unreadable_input_makes_a_failed_batch_and_files_expire(sessions):
    t, _, b = await make_batch(sessions, content=b"\xff\xfe")
    assert b.status == "failed" and b.errors[0]["param"] == "input_file_id" and b.total == 0
    async with sessions() as s:
        f = await store.create_file(s, tenant_id=t.id, purpose="batch", filename="x", content=b"{}",
                                    expires_after_s=3600)
    async with sessions() as s:
        with pytest.raises(NotFound):
            await store.get_file(s, file_id=f.id, tenant_id="ten_other")
        assert await store.sweep_files(s) == 0
        assert await store.sweep_files(s, now=utcnow() + timedelta(hours=2)) == 1
        assert await s.scalar(select(func.count()).select_from(StoredFile).where(StoredFile.id == f.id)) == 0
