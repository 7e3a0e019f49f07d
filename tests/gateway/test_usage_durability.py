"""Usage is never lost and never invented (issue 14, findings 3, 4 and 7's request id): a live
`lockgate serve` on PostgreSQL, the official `openai` client, rows read back with psycopg.

The usage rule for a request that ends early: exactly one row, `cancelled` (client gone,
shutdown, `request_timeout_s`) or `error`; its prompt tokens count if prefill ran, its
completion tokens are those sent to the client, and the limiter is settled to exactly what
the row says (read back from the next request's `x-ratelimit-remaining-tokens`).
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psycopg
import pytest

from tests.support.gateway_server import GatewayServer
from tests.support.helpers import demo_model
from tests.support.services import fresh_pg_database
from tests.support.throwaway_pg import throwaway_postgres

MODEL = "tiny"
TPM = 1_000_000
PROMPT = [100 + j for j in range(8)]     # 8 token ids, none special


def rows(url: str, tenant_id: str) -> list[dict]:
    with psycopg.connect(url.replace("postgresql+asyncpg", "postgresql"), connect_timeout=3) as conn:
        cur = conn.execute("SELECT * FROM usage_records WHERE tenant_id = %s", (tenant_id,))
        names = [d.name for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def wait_rows(url: str, tenant_id: str, num: int, timeout: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = rows(url, tenant_id)
        if len(got) >= num or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def client(srv: GatewayServer, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, **kw)


def settled_tokens(srv: GatewayServer, key: str) -> int:
    """What the tenant's minute window holds, from a probe request's remaining-tokens header
    (the probe reserves its own 8 + 1 tokens, taken off again here)."""
    r = httpx.post(srv.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return TPM - int(r.headers["x-ratelimit-remaining-tokens"]) - (len(PROMPT) + 1)


@pytest.fixture
def pg(tmp_path):
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One server on default settings for the tests that need nothing else: (server, db url)."""
    with fresh_pg_database() as url:
        srv = serve(tmp_path_factory.mktemp("shared"), url)
        try:
            yield srv, url
        finally:
            srv.stop()


def serve(tmp_path, url: str, **env: str) -> GatewayServer:
    return GatewayServer.start(tmp_path / "srv", database_url=url, models={MODEL: demo_model("llama", "tiny", 0)},
                               extra_env={f"LOCKGATE_{k.upper()}": v for k, v in env.items()})


def tenant(srv: GatewayServer) -> tuple[dict, str]:
    return srv.tenant(quota={"tokens_per_minute": TPM})


def read_stream(srv: GatewayServer, key: str, started: threading.Barrier | None = None,
                max_chunks: int | None = None, **kw) -> tuple[int, BaseException | None]:
    """Stream a long completion; (completion tokens received, the error the stream ended with)."""
    received = 0
    try:
        stream = client(srv, key, timeout=30).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2000, stream=True, logprobs=0,
            extra_body={"ignore_eos": True}, **kw)
        for chunk in stream:
            received += len(chunk.choices[0].logprobs.tokens) if chunk.choices else 0
            if started is not None and received >= 4:
                started.wait(10)
                started = None
            if max_chunks is not None and received >= max_chunks:
                stream.close()
                return received, None
    except openai.APIError as exc:
        return received, exc
    return received, None


def test_sigterm_past_shutdown_timeout_cuts_streams_with_error_and_rows(tmp_path, pg):
    """Finding 3: streams still running when `shutdown_timeout_s` runs out end with an error
    event (`data: {"error": {"code": "server_shutdown"}}`, then the stream closes) and each
    has exactly one row, `cancelled`, with the tokens the client received, written before the
    usage writer closed."""
    srv = serve(tmp_path, pg, shutdown_timeout_s="0.3")
    try:
        t, key = tenant(srv)
        num = 3
        started = threading.Barrier(num + 1)
        with ThreadPoolExecutor(num) as pool:
            futs = [pool.submit(read_stream, srv, key, started) for _ in range(num)]
            started.wait(30)
            srv.proc.send_signal(signal.SIGTERM)
            results = [f.result(60) for f in futs]
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()
    for received, exc in results:
        assert isinstance(exc, openai.APIError), (received, exc)
        assert "shutting down" in exc.message
        assert 4 <= received < 2000
    got = rows(pg, t["id"])
    assert "UsageWriter is closed" not in srv.log()
    assert sorted(r["completion_tokens"] for r in got) == sorted(n for n, _ in results)
    assert [r["status"] for r in got] == ["cancelled"] * num
    assert all(r["prompt_tokens"] == len(PROMPT) for r in got)


def test_stream_client_gone_row_matches_the_limiter(shared):
    """A client that leaves mid-stream: one `cancelled` row, its prompt and at least the
    completion tokens the client read; the limiter holds exactly what the row says."""
    srv, pg = shared
    t, key = tenant(srv)
    received, exc = read_stream(srv, key, max_chunks=5)
    assert exc is None and received >= 5
    [row] = wait_rows(pg, t["id"], 1)
    assert row["status"] == "cancelled" and row["prompt_tokens"] == len(PROMPT)
    assert received <= row["completion_tokens"] < 2000
    assert settled_tokens(srv, key) == row["prompt_tokens"] + row["completion_tokens"]


def test_non_streaming_client_gone_bills_no_completion(shared):
    """A non-streaming client that leaves was sent no completion: its row counts the prompt
    (prefill ran) and 0 completion tokens, and the limiter holds exactly that."""
    srv, pg = shared
    t, key = tenant(srv)
    with pytest.raises(openai.APITimeoutError):
        client(srv, key, timeout=0.5).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2000, extra_body={"ignore_eos": True})
    [row] = wait_rows(pg, t["id"], 1)
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == ("cancelled", len(PROMPT), 0)
    assert settled_tokens(srv, key) == len(PROMPT)


def test_request_timeout_ends_runs_with_an_error_and_a_row(tmp_path, pg):
    """Finding 7: `request_timeout_s` bounds a request end to end: a stream over it ends with
    an error event (`request_timeout`), a JSON request is answered 504; each one row,
    `cancelled`, settled to what the row says."""
    srv = serve(tmp_path, pg, request_timeout_s="0.4")
    try:
        t, key = tenant(srv)
        received, exc = read_stream(srv, key)
        assert isinstance(exc, openai.APIError) and "request_timeout_s" in exc.message, exc
        with pytest.raises(openai.APIStatusError) as err:
            client(srv, key, timeout=30).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2000, extra_body={"ignore_eos": True})
        assert err.value.status_code == 504 and "request_timeout_s" in err.value.message
        got = sorted(wait_rows(pg, t["id"], 2), key=lambda r: -r["completion_tokens"])
        assert [r["status"] for r in got] == ["cancelled", "cancelled"]
        assert (got[0]["completion_tokens"], got[1]["completion_tokens"]) == (received, 0)
        assert settled_tokens(srv, key) == sum(r["prompt_tokens"] + r["completion_tokens"] for r in got)
    finally:
        srv.stop()


def test_client_request_id_is_stored_on_the_usage_row(shared):
    """Finding 7: the client's `x-request-id` is echoed and stored on its usage row."""
    srv, pg = shared
    t, key = tenant(srv)
    r = httpx.post(srv.url + "/v1/completions", timeout=30,
                   headers={"Authorization": f"Bearer {key}", "x-request-id": "client-abc-123"},
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-abc-123"
    [row] = wait_rows(pg, t["id"], 1)
    assert row.get("client_request_id") == "client-abc-123"


def test_database_down_usage_is_spooled_then_replayed_once(tmp_path):
    """Finding 4, with a PostgreSQL this test stops and restarts: admitted requests, streamed
    and not, are answered in full and billed through the spool; `/ready` says degraded; admin
    routes and keys not in the key cache get 503 `database_unavailable` (what is refused while
    the database is down); once it is back the spooled rows are in it, each exactly once."""
    with throwaway_postgres() as pg:
        srv = GatewayServer.start(tmp_path / "srv", database_url=pg.url,
                                  models={MODEL: demo_model("llama", "tiny", 0)},
                                  extra_env={"LOCKGATE_KEY_CACHE_TTL_S": "60", "LOCKGATE_DATABASE_TIMEOUT_S": "1",
                                             "LOCKGATE_USAGE_REPLAY_INTERVAL_S": "0.2"})
        try:
            t, key = tenant(srv)
            oai = client(srv, key, timeout=30)
            oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)   # the key is cached now
            srv.admin.get("/tenants")                                           # and the admin key
            pg.stop()
            stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
            *_, last = list(stream)
            assert last.usage.completion_tokens == 20
            done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 5
            ready = httpx.get(srv.url + "/ready", timeout=10)
            assert ready.status_code == 200, ready.text
            assert ready.json()["status"] == "degraded" and ready.json()["database"] is False
            assert ready.json()["usage_spooled"] == 2
            r = srv.admin.get("/tenants")
            assert (r.status_code, r.json()["error"]["code"]) == (503, "database_unavailable"), r.text
            with pytest.raises(openai.APIStatusError) as err:          # a key not in the cache
                client(srv, "lg-" + "x" * 40).models.list()
            assert err.value.status_code == 503 and err.value.code == "database_unavailable"
            pg.start()
            deadline = time.monotonic() + 10
            while httpx.get(srv.url + "/ready", timeout=10).json()["status"] != "ready":
                assert time.monotonic() < deadline, "the spool was not replayed"
                time.sleep(0.1)
            got = rows(pg.url, t["id"])
            assert sorted(r["completion_tokens"] for r in got) == [2, 5, 20]
            assert len({r["request_id"] for r in got}) == 3 and {r["status"] for r in got} == {"ok"}
        finally:
            srv.stop()
