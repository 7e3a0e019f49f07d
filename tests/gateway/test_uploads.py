"""Uploads to `/v1/files` in process, on both backends (the `gateway` fixture): a file's bytes
come back exactly as uploaded (NUL characters, escaped or raw, included) and its batch runs
on PostgreSQL as on SQLite; an upload is admitted as any request (the tenant's concurrency
limit applies before its body is read); the caps on uploads in flight answer 429 with
Retry-After. (The process's memory under concurrent uploads, and the deadline on a slow body:
test_hostile_connections.py.)"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from lockgate.gateway.batch_api import UploadGate
from lockgate.gateway.errors import APIError
from tests.support.batch_lines import FAST, FINAL

pytestmark = pytest.mark.asyncio(loop_scope="module")

GATEWAY_OPTIONS = {**FAST, "max_tenant_uploads_in_flight": 2}


def multipart(content: bytes, boundary: str = "lgtestboundary") -> tuple[bytes, dict[str, str]]:
    body = (f"--{boundary}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            "content-type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


async def wait_final(gateway, key: str, batch_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        b = (await gateway.http.get(f"/v1/batches/{batch_id}", headers=gateway.auth(key))).json()
        if b["status"] in FINAL:
            return b
        assert time.monotonic() < deadline, b
        await asyncio.sleep(0.1)


def line(custom_id: str, content: str) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "max_tokens": 2,
                                "messages": [{"role": "user", "content": content}]}})


async def test_nul_characters_round_trip_and_their_batch_completes(gateway):
    _, key = await gateway.tenant()
    h = gateway.auth(key)
    escaped = line("nul\u0000id", "before\u0000after")       # json.dumps writes \u0000
    assert "\\u0000" in escaped
    raw = escaped.replace("\\u0000", "\x00", 1)               # a raw NUL byte: not JSON
    content = (escaped + "\n" + raw + "\n" + line("plain", "hi") + "\n").encode()
    body, headers = multipart(content)
    r = await gateway.http.post("/v1/files", headers={**h, **headers}, content=body)
    assert r.status_code == 200, r.text
    fid = r.json()["id"]
    assert r.json()["bytes"] == len(content)
    got = await gateway.http.get(f"/v1/files/{fid}/content", headers=h)
    assert got.status_code == 200 and got.content == content
    r = await gateway.http.post("/v1/batches", headers=h, json={
        "input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert r.status_code == 200, r.text
    b = await wait_final(gateway, key, r.json()["id"])
    assert b["status"] == "completed", b
    assert b["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    out = (await gateway.http.get(f"/v1/files/{b['output_file_id']}/content", headers=h)).content
    answered = {json.loads(x)["custom_id"]: json.loads(x) for x in out.decode().splitlines()}
    assert set(answered) == {"nul\u0000id", "plain"}
    assert answered["nul\u0000id"]["response"]["status_code"] == 200
    err = (await gateway.http.get(f"/v1/files/{b['error_file_id']}/content", headers=h)).content
    assert [json.loads(x)["error"]["code"] for x in err.decode().splitlines()] == ["invalid_json_line"]


FILE = "".join(line(f"r{i}", "x" * 500) + "\n" for i in range(40)).encode()    # 40 lines, 24 KB


class HeldBody:
    """An upload's body that sends its first part, then waits for `release` to send the rest."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    async def __aiter__(self):
        self.started.set()
        yield self.body[:100]
        await self.release.wait()
        yield self.body[100:]


async def test_an_upload_is_admitted_under_the_tenants_concurrency_limit(gateway):
    _, key = await gateway.tenant(quota={"max_concurrent_requests": 1})
    h = gateway.auth(key)
    body, headers = multipart(FILE)
    held = HeldBody(body)
    first = asyncio.create_task(gateway.http.post("/v1/files", headers={**h, **headers}, content=held))
    await held.started.wait()
    await asyncio.sleep(0.2)
    r = await gateway.http.post("/v1/files", headers={**h, **headers}, content=body)
    assert r.status_code == 429, r.text
    assert "max_concurrent_requests" in r.json()["error"]["message"]
    held.release.set()
    assert (await first).status_code == 200
    # the slot came back with the first upload's end
    r = await gateway.http.post("/v1/files", headers={**h, **headers}, content=body)
    assert r.status_code == 200, r.text


async def test_past_the_tenants_uploads_in_flight_an_upload_is_429_with_retry_after(gateway):
    _, key = await gateway.tenant()
    h = gateway.auth(key)
    body, headers = multipart(FILE)
    held = [HeldBody(body) for _ in range(2)]
    tasks = [asyncio.create_task(gateway.http.post("/v1/files", headers={**h, **headers}, content=b))
             for b in held]
    for b in held:
        await b.started.wait()
    await asyncio.sleep(0.2)
    r = await gateway.http.post("/v1/files", headers={**h, **headers}, content=body)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_uploads", r.text
    assert int(r.headers["retry-after"]) >= 1
    _, other = await gateway.tenant()          # another tenant's upload is not held up
    r = await gateway.http.post("/v1/files", headers={**gateway.auth(other), **headers}, content=body)
    assert r.status_code == 200, r.text
    for b in held:
        b.release.set()
    assert [(await t).status_code for t in tasks] == [200, 200]


async def test_a_chunked_upload_over_the_limit_is_413_as_it_arrives(gateway):
    _, key = await gateway.tenant()
    body, headers = multipart(b"x" * (200 << 10))     # past max_file_bytes and the multipart framing

    async def chunked():
        for at in range(0, len(body), 16 << 10):
            yield body[at:at + (16 << 10)]

    r = await gateway.http.post("/v1/files", headers={**gateway.auth(key), **headers}, content=chunked())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    # the refused upload left its slot and its admission
    r = await gateway.http.post("/v1/files", headers={**gateway.auth(key), **headers}, content=multipart(FILE)[0])
    assert r.status_code == 200, r.text


async def test_the_replicas_cap_counts_every_tenants_uploads():
    gate = UploadGate(per_replica=2, per_tenant=2)
    with gate.slot("a"), gate.slot("b"):
        with pytest.raises(APIError) as refused, gate.slot("c"):
            pass
        assert refused.value.status == 429 and refused.value.headers["retry-after"] == "1"
    with gate.slot("c"):
        assert gate.total == 1 and dict(gate.by_tenant) == {"c": 1}
    assert gate.total == 0 and not gate.by_tenant
