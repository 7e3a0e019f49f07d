"""Two `lockgate serve` replicas sharing one PostgreSQL database and one Redis: the limits hold
exactly under concurrent load spread over both (no replica lets an extra request in); a key
revoked or a tenant suspended on one is refused by the other; an adapter registered on one
is served by the other, which stops within the cache TTL once it is deleted; a console session
made on one is good on the other, and signing out or revoking its key on one ends it on both.

The replicas have the same pepper, admin key and Redis prefix; the first migrates the
database (`--migrate`), the second finds it at head. Requests alternate between the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.gateway_server import GatewayServer
from tests.support.helpers import demo_model, special_ids
from tests.support.lora import MAX_LORA_RANK, MESSAGES, NEW_TOKENS, expected_text, install
from tests.support.services import check_redis, drop_redis_prefix, fresh_pg_database

PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]   # ten ordinary token ids: a known prompt length
TTL = 1.0                                          # LOCKGATE_ADAPTER_CACHE_TTL_S of both replicas


@dataclass
class Pair:
    a: GatewayServer
    b: GatewayServer
    adapter_root: Path

    @property
    def servers(self) -> tuple[GatewayServer, GatewayServer]:
        return self.a, self.b

    def tenant(self, **fields) -> tuple[dict, str]:
        return self.a.tenant(**fields)

    def engine(self, srv: GatewayServer) -> dict:
        return srv.admin.get("/engine").json()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    assert not set(PROMPT) & special_ids(demo_model("llama", "tiny", 0))
    redis_url = check_redis()
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    pepper = secrets.token_hex(32)
    admin_key = "lg-" + secrets.token_urlsafe(32)
    models = {"tiny": demo_model("llama", "tiny", 0)}
    root = tmp_path_factory.mktemp("replicas")
    adapter_root = root / "adapter-root"        # one directory both replicas read adapters from
    adapter_root.mkdir()
    env = {"LOCKGATE_ADAPTER_ROOT": str(adapter_root), "LOCKGATE_MAX_LORA_RANK": str(MAX_LORA_RANK),
           "LOCKGATE_ADAPTER_CACHE_TTL_S": str(TTL)}
    common = dict(redis_url=redis_url, redis_prefix=prefix, pepper=pepper, admin_key=admin_key,
                  models=models, extra_env=env)
    with fresh_pg_database() as url:
        a = GatewayServer.start(root / "a", database_url=url, **common)
        try:
            b = GatewayServer.start(root / "b", database_url=url, **common)
            try:
                yield Pair(a, b, adapter_root)
            finally:
                b.stop()
        finally:
            a.stop()
            drop_redis_prefix(prefix)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def completion_body(max_tokens: int, **extra) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **extra}


def error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@contextlib.asynccontextmanager
async def clients(pair: Pair, key: str, n: int):
    """One AsyncClient per replica, each allowed `n` connections, connections warmed and the
    key authenticated on both (GET /v1/models costs no quota)."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    cs = [httpx.AsyncClient(base_url=s.url, headers=auth(key), timeout=120, limits=limits)
          for s in pair.servers]
    try:
        for r in await asyncio.gather(*(c.get("/v1/models") for c in cs)):
            assert r.status_code == 200, r.text
        yield cs
    finally:
        for c in cs:
            await c.aclose()


async def burst(pair: Pair, key: str, n: int, body: dict) -> tuple[list[httpx.Response], float]:
    """`n` concurrent POST /v1/completions alternating between the replicas: the responses
    (in send order) and the send window, from the first request's first header byte on the
    wire to the last request's last body byte (httpcore's trace events)."""
    starts: list[float] = []
    ends: list[float] = []

    async def trace(event: str, info: dict) -> None:
        if event == "http11.send_request_headers.started":
            starts.append(time.perf_counter())
        elif event == "http11.send_request_body.complete":
            ends.append(time.perf_counter())

    async with clients(pair, key, n) as cs:
        starts.clear()
        ends.clear()
        rs = await asyncio.gather(*(cs[i % 2].post("/v1/completions", json=body,
                                                    extensions={"trace": trace})
                                    for i in range(n)))
    assert len(starts) == n and len(ends) == n
    return list(rs), max(ends) - min(starts)


def test_requests_per_minute_is_exact_across_replicas(pair):
    """A key limited to 10 requests per minute, 100 concurrent requests over both replicas
    within 2 s: exactly 10 pass, the other 90 are 429 rate_limit_exceeded."""
    t, _ = pair.tenant()
    r = pair.a.admin.post(f"/tenants/{t['id']}/keys",
                          json={"name": "rpm", "quota": {"requests_per_minute": 10}})
    assert r.status_code == 201, r.text
    key = r.json()["key"]
    rs, window = asyncio.run(burst(pair, key, 100, completion_body(1)))
    assert window < 2.0, f"the 100 requests took {window:.2f} s to send"
    statuses = Counter(r.status_code for r in rs)
    assert statuses == {200: 10, 429: 90}, statuses
    assert Counter(error_code(r) for r in rs if r.status_code == 429) == {"rate_limit_exceeded": 90}
    for r in rs:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 1
            assert r.headers["x-ratelimit-limit-requests"] == "10"
        else:
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
            assert 1 <= int(r.headers["retry-after"]) <= 60
    # the 11th request is refused on both replicas, long after the burst too
    for srv in pair.servers:
        r = httpx.post(srv.url + "/v1/completions", headers=auth(key), json=completion_body(1),
                       timeout=60)
        assert r.status_code == 429 and error_code(r) == "rate_limit_exceeded", r.text
    rows = pair.a.admin.get("/usage", params={"tenant_id": t["id"]}).json()["data"]
    assert rows[0]["requests"] == 10 and rows[0]["ok"] == 10


def test_daily_token_budget_is_exact_across_replicas(pair):
    """A daily budget of exactly ten requests' worth of tokens (prompt + max_tokens, which the
    requests use in full thanks to ignore_eos): 40 concurrent requests -> 10 admitted, 30
    insufficient_quota, and the usage rows add up to the budget, not more."""
    max_tokens = 2
    per_request = len(PROMPT) + max_tokens
    budget = 10 * per_request
    t, key = pair.tenant(quota={"daily_token_budget": budget})
    rs, window = asyncio.run(burst(pair, key, 40, completion_body(max_tokens)))
    assert window < 2.0
    statuses = Counter(r.status_code for r in rs)
    assert statuses == {200: 10, 429: 30}, statuses
    refused = [r for r in rs if r.status_code == 429]
    assert all(error_code(r) == "insufficient_quota" for r in refused), refused[0].text
    assert all(r.headers["x-should-retry"] == "false" for r in refused)
    for r in rs:
        if r.status_code == 200:
            assert r.json()["usage"]["total_tokens"] == per_request
    rows = pair.b.admin.get("/usage", params={"tenant_id": t["id"]}).json()["data"]
    assert rows[0]["requests"] == 10 and rows[0]["ok"] == 10
    assert rows[0]["total_tokens"] == budget          # never more than the budget
    # spent: not even a one-token request gets in, on either replica
    for srv in pair.servers:
        r = httpx.post(srv.url + "/v1/completions", headers=auth(key), timeout=60,
                       json={"model": "tiny", "prompt": [40], "max_tokens": 1})
        assert r.status_code == 429 and error_code(r) == "insufficient_quota", r.text


def test_max_concurrent_requests_never_exceeded(pair):
    """max_concurrent_requests=3, 20 concurrent long streams over both replicas: exactly 3
    are admitted, the tenant never has more than 3 requests in either engine (summed over the
    replicas), and once they finish the next request gets in."""
    t, key = pair.tenant(quota={"max_concurrent_requests": 3})
    tid = t["id"]
    max_tokens = 1500         # ~1.5-3 s of generation: the whole burst is decided meanwhile
    body = completion_body(max_tokens, stream=True, stream_options={"include_usage": True})
    samples: list[tuple[int, int]] = []

    async def run() -> list[tuple[int, object]]:
        done = asyncio.Event()
        admin_cs = [httpx.AsyncClient(base_url=s.url + "/admin/v1", headers=auth(s.admin_key),
                                      timeout=30) for s in pair.servers]

        async def sample() -> None:
            while not done.is_set():
                engs = await asyncio.gather(*(c.get("/engine") for c in admin_cs))
                engs = [e.json() for e in engs]
                tenant = sum(e["models"]["tiny"]["running_by_tenant"].get(tid, 0)
                             + e["models"]["tiny"]["waiting_by_tenant"].get(tid, 0) for e in engs)
                samples.append((tenant, sum(e["inflight_requests"] for e in engs)))
                await asyncio.sleep(0.02)

        async def one(c: httpx.AsyncClient) -> tuple[int, object]:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return r.status_code, error_code(r)
                lines = [ln async for ln in r.aiter_lines() if ln]
                return 200, lines

        try:
            async with clients(pair, key, 20) as cs:
                sampler = asyncio.ensure_future(sample())
                try:
                    return await asyncio.gather(*(one(cs[i % 2]) for i in range(20)))
                finally:
                    done.set()
                    await sampler
        finally:
            for c in admin_cs:
                await c.aclose()

    results = asyncio.run(run())
    statuses = Counter(s for s, _ in results)
    assert statuses == {200: 3, 429: 17}, statuses
    assert all(code == "rate_limit_exceeded" for s, code in results if s == 429)
    for s, lines in results:
        if s == 200:
            assert lines[-1] == "data: [DONE]"
            assert f'"completion_tokens":{max_tokens}' in lines[-2]
    assert samples
    peak_tenant = max(n for n, _ in samples)
    peak_inflight = max(n for _, n in samples)
    assert peak_tenant <= 3 and peak_inflight <= 3, samples
    assert peak_tenant == 3, f"the three admitted streams never ran together: {samples}"
    # the leases are released at the end of each stream: the next request gets in at once
    for srv in pair.servers:
        assert pair.engine(srv)["inflight_requests"] == 0
        r = httpx.post(srv.url + "/v1/completions", headers=auth(key), json=completion_body(1),
                       timeout=60)
        assert r.status_code == 200, r.text


def _first_token(lines) -> None:
    for ln in lines:
        if ln.startswith("data: ") and '"text":"' in ln and '"text":""' not in ln:
            return
    raise AssertionError("the stream ended before its first token")


def _poll_admitted(url: str, key: str, body: dict, seconds: float = 5.0) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while True:
        r = httpx.post(url + "/v1/completions", headers=auth(key), json=body, timeout=60)
        if r.status_code != 429 or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_disconnect_settles_tokens_per_minute_reservation(pair):
    """A stream reserving almost the whole tokens_per_minute is dropped after its first token:
    within seconds a request that does not fit beside the full reservation passes on the other
    replica (the dropped one was settled to the tokens it used), and its row says cancelled."""
    big = 1500
    probe = 100
    tpm = len(PROMPT) + big + probe - 1          # the probe fits only once `big` is settled
    t, key = pair.tenant(quota={"tokens_per_minute": tpm})
    with (httpx.Client(base_url=pair.a.url, headers=auth(key), timeout=60) as c,
          c.stream("POST", "/v1/completions", json=completion_body(big, stream=True)) as r):
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()   # kept: a dropped line iterator closes the connection
        _first_token(lines)
        # while the reservation stands, the probe cannot get in on either replica
        blocked = httpx.post(pair.b.url + "/v1/completions", headers=auth(key), timeout=60,
                             json=completion_body(probe))
        assert blocked.status_code == 429 and error_code(blocked) == "rate_limit_exceeded"
        assert "tokens_per_minute" in blocked.json()["error"]["message"]
    # leaving the block closed the connection mid-stream
    t0 = time.monotonic()
    r = _poll_admitted(pair.b.url, key, completion_body(probe))
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 5
    assert r.json()["usage"]["completion_tokens"] == probe
    rows = pair.a.admin.get("/usage", params={"tenant_id": t["id"]}).json()["data"]
    assert rows[0]["requests"] == 2 and rows[0]["cancelled"] == 1 and rows[0]["ok"] == 1
    assert rows[0]["completion_tokens"] < big     # the dropped stream was cut short
    for srv in pair.servers:
        assert pair.engine(srv)["inflight_requests"] == 0


def test_disconnect_frees_concurrency_lease(pair):
    """max_concurrent_requests=1: a stream on one replica holds the lease (the other replica
    refuses); dropping the stream frees it, and the other replica admits within seconds."""
    t, key = pair.tenant(quota={"max_concurrent_requests": 1})
    with (httpx.Client(base_url=pair.b.url, headers=auth(key), timeout=60) as c,
          c.stream("POST", "/v1/completions", json=completion_body(1500, stream=True)) as r):
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()   # kept: a dropped line iterator closes the connection
        _first_token(lines)
        blocked = httpx.post(pair.a.url + "/v1/completions", headers=auth(key), timeout=60,
                             json=completion_body(1))
        assert blocked.status_code == 429 and error_code(blocked) == "rate_limit_exceeded"
        assert "max_concurrent_requests" in blocked.json()["error"]["message"]
    t0 = time.monotonic()
    r = _poll_admitted(pair.a.url, key, completion_body(1))
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 < 5
    rows = pair.a.admin.get("/usage", params={"tenant_id": t["id"]}).json()["data"]
    assert rows[0]["cancelled"] == 1 and rows[0]["ok"] == 1


def poll(fn, timeout: float = 5.0, every: float = 0.25) -> tuple[bool, float]:
    """Call `fn` until it returns true or `timeout` passes: (succeeded, elapsed seconds)."""
    t0 = time.monotonic()
    while True:
        if fn():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0
        time.sleep(every)


def test_revocation_and_suspension_reach_the_other_replica(pair):
    """A key cached on both replicas and revoked on one is refused (`revoked`) by that one at
    once and by the other within seconds; the other serves the admin API off the same
    database; a tenant suspended on one is refused by the other, then let back in; and a key
    revoked through the second replica is refused by the first."""
    a, b = pair.servers
    t, _ = pair.tenant()
    r = a.admin.post(f"/tenants/{t['id']}/keys", json={"name": "to-revoke"})
    assert r.status_code == 201, r.text
    k = r.json()
    t2, key2 = pair.tenant()

    def status(srv: GatewayServer, key: str) -> httpx.Response:
        return httpx.get(srv.url + "/v1/models", timeout=30, headers=auth(key))

    def err(r: httpx.Response) -> dict:
        return r.json().get("error") or {}

    # warm: every replica has the keys cached
    for srv in pair.servers:
        assert status(srv, k["key"]).status_code == 200
        assert status(srv, key2).status_code == 200
    r = a.admin.delete(f"/keys/{k['id']}")
    assert r.status_code == 200 and r.json()["revoked"] is True
    times = {}
    for srv in pair.servers:
        ok, elapsed = poll(lambda srv=srv: status(srv, k["key"]).status_code == 401)
        times[srv.url] = round(elapsed, 2)
        assert ok and elapsed < 5, f"revoked key still accepted by {srv.url} after {elapsed:.2f}s"
        assert err(status(srv, k["key"]))["code"] == "revoked"
    assert times[a.url] < 0.5, times        # the revoking replica forgets it at once
    got = a.admin.get(f"/keys/{k['id']}").json()
    assert got["revoked_at"] is not None
    # revoking again changes nothing
    assert a.admin.delete(f"/keys/{k['id']}").status_code == 200
    assert a.admin.get(f"/keys/{k['id']}").json()["revoked_at"] == got["revoked_at"]

    # the second replica serves the admin API off the same database
    assert b.admin.get(f"/tenants/{t2['id']}").status_code == 200
    # a tenant suspended on one replica is refused by the other, then let back in
    assert a.admin.patch(f"/tenants/{t2['id']}", json={"status": "suspended"}).status_code == 200
    ok, elapsed = poll(lambda: status(b, key2).status_code == 401)
    assert ok and elapsed < 5, elapsed
    assert err(status(b, key2))["code"] == "tenant_suspended"
    assert a.admin.patch(f"/tenants/{t2['id']}", json={"status": "active"}).status_code == 200
    ok, elapsed = poll(lambda: status(b, key2).status_code == 200)
    assert ok and elapsed < 5, elapsed
    # and a key revoked through the second replica is refused by the first
    r = a.admin.post(f"/tenants/{t2['id']}/keys", json={"name": "via-replica"})
    assert r.status_code == 201, r.text
    k3 = r.json()
    assert status(a, k3["key"]).status_code == 200
    assert b.admin.delete(f"/keys/{k3['id']}").status_code == 200
    ok, elapsed = poll(lambda: status(a, k3["key"]).status_code == 401)
    assert ok and elapsed < 5, elapsed
    print(f"revocation seen after (s): {times}")


def test_second_replica_learns_and_forgets_adapters(pair):
    """An adapter registered on one replica: the other lists it, reads it on first use (HF +
    peft's greedy tokens), and once it is deleted on the first, stops serving it within the
    cache TTL and lets its engine drop it (the sweep, every TTL)."""
    a, b = pair.servers
    t, key_a = pair.tenant()

    def chat(srv: GatewayServer, model: str) -> str:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key_a, max_retries=0, timeout=60)
        r = c.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NEW_TOKENS,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.model == model and r.usage.completion_tokens == NEW_TOKENS
        return r.choices[0].message.content

    def in_cpu(srv: GatewayServer) -> list[str]:
        return srv.admin.get("/engine").json()["models"]["tiny"]["lora"]["in_cpu"]

    r = a.admin.post("/adapters", json={"name": "ada-rep", "base_model": "tiny", "owner_tenant_id": t["id"],
                                        "path": install(pair.adapter_root, "own", "rep")})
    assert r.status_code == 201, r.text
    rep = r.json()
    assert b.admin.get(f"/adapters/{rep['id']}").json()["registered"] is False
    c_b = openai.OpenAI(base_url=b.url + "/v1", api_key=key_a, max_retries=0, timeout=60)
    assert "ada-rep" in {m.id for m in c_b.models.list().data}
    assert chat(b, "ada-rep") == expected_text("own")          # read lazily on b
    assert b.admin.get(f"/adapters/{rep['id']}").json()["registered"] is True

    assert a.admin.delete(f"/adapters/{rep['id']}").status_code == 200
    t0 = time.monotonic()
    while True:
        try:
            chat(b, "ada-rep")
        except openai.NotFoundError:
            break
        assert time.monotonic() - t0 < TTL + 2, "replica b still serves a deleted adapter"
        time.sleep(0.1)
    # and b's engine lets go of it (the sweep, every TTL)
    deadline = time.monotonic() + 3 * TTL + 2
    while "ada-rep" in in_cpu(b):
        assert time.monotonic() < deadline, "timed out waiting for b's engine to drop the adapter"
        time.sleep(0.05)
    assert chat(b, "tiny") == expected_text(None)


def test_a_responses_chain_continues_on_the_other_replica(pair):
    """OpenAI's Responses API over two replicas: a response stored on one is continued
    (`previous_response_id`) and read on the other; another tenant gets a 404 on either; one
    deleted on the other is gone on both; `store: false` leaves nothing either can read."""
    _, key = pair.tenant()
    _, other_key = pair.tenant()
    ca, cb = (openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=60)
              for s in pair.servers)
    first = ca.responses.create(model="tiny", input="Remember the word paging.", max_output_tokens=4)
    assert first.status in ("completed", "incomplete") and first.usage.output_tokens >= 1
    second = cb.responses.create(model="tiny", input="Which word?", previous_response_id=first.id,
                                 max_output_tokens=4)
    # the second request's prompt holds the first exchange: more input tokens than its own text
    assert second.usage.input_tokens > first.usage.input_tokens
    assert cb.responses.retrieve(first.id).id == first.id
    assert [i.id for i in ca.responses.input_items.list(second.id).data]
    for s in pair.servers:
        other = openai.OpenAI(base_url=s.url + "/v1", api_key=other_key, max_retries=0, timeout=60)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
    cb.responses.delete(first.id)
    for c in (ca, cb):
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
    unstored = ca.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    for c in (ca, cb):
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(unstored.id)


def _console_sign_in(srv: GatewayServer, key: str) -> str:
    """A console session on `srv` for `key`: its cookie's token."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        form = c.get("/console/sign-in")
        csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', form.text).group(1)
        r = c.post("/console/sign-in", data={"key": key, "csrf": csrf})
        assert r.status_code == 303, r.text
        return c.cookies["lockgate_console"]


def _console_get(srv: GatewayServer, token: str, path: str = "/console/keys") -> httpx.Response:
    return httpx.get(srv.url + path, cookies={"lockgate_console": token}, timeout=30)


def test_a_console_session_holds_on_both_replicas_and_ends_on_both(pair):
    """A session made on one replica is good on the other (sessions live in the database);
    signing out on one, or revoking the session's admin key on one, ends it on both."""
    r = pair.a.admin.post("/keys", json={"name": "console-replicas"})
    assert r.status_code == 201, r.text
    key_id, key = r.json()["id"], r.json()["key"]
    token = _console_sign_in(pair.a, key)
    for srv in pair.servers:
        page = _console_get(srv, token)
        assert page.status_code == 200 and "console-replicas" in page.text, page.text[:500]
    # signed out on b: refused on a and b
    csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', _console_get(pair.b, token).text).group(1)
    r = httpx.post(pair.b.url + "/console/sign-out", data={"csrf": csrf}, cookies={"lockgate_console": token},
                   timeout=30)
    assert r.status_code == 303, r.text
    assert [_console_get(srv, token).status_code for srv in pair.servers] == [401, 401]
    # a fresh session on b, the key revoked through a's API: refused on both at once
    token = _console_sign_in(pair.b, key)
    assert [_console_get(srv, token).status_code for srv in pair.servers] == [200, 200]
    assert pair.a.admin.delete(f"/keys/{key_id}").status_code == 200
    for srv in pair.servers:
        r = _console_get(srv, token)
        assert r.status_code == 401 and 'name="key"' in r.text, (srv.url, r.status_code)
