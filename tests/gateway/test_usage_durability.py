"""Usage is never lost and never invented: the gateway in process on PostgreSQL (the fake
engine, a token every 5 ms: a long answer is still running when the test acts), the official
`openai` client, rows read back with psycopg.

The usage rule for a request that ends early: exactly one row, `cancelled` (client gone,
shutdown, `request_timeout_s`) or `error`; its prompt tokens count if prefill ran, its
completion tokens are those sent to the client, and the limiter is settled to exactly what
the row says (read back from the next request's `x-ratelimit-remaining-tokens`); the
client's `x-request-id` is on its row. The same for the Responses and Messages streams. (A
shutdown by SIGTERM, on a real process: test_usage_on_shutdown.py; a kill -9 of every route's
streams: tests/e2e/test_chaos.py.)
"""

from __future__ import annotations

import asyncio
import time

import openai
import psycopg
import pytest
import pytest_asyncio

from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import running_gateway
from tests.support.throwaway_pg import throwaway_postgres

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "tiny"
TPM = 1_000_000
PROMPT = [100 + j for j in range(8)]     # 8 token ids, none special
ENGINE = {"token_interval_s": 0.005}


def rows(url: str, tenant_id: str) -> list[dict]:
    with psycopg.connect(url.replace("postgresql+asyncpg", "postgresql"), connect_timeout=3) as conn:
        cur = conn.execute("SELECT * FROM usage_records WHERE tenant_id = %s", (tenant_id,))
        names = [d.name for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


async def wait_rows(url: str, tenant_id: str, num: int, timeout: float = 5.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        got = rows(url, tenant_id)
        if len(got) >= num or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


def client(gw, key: str, **kw) -> openai.AsyncOpenAI:
    return gw.openai(key, **kw)


async def settled_tokens(gw, key: str) -> int:
    """What the tenant's minute window holds, from a probe request's remaining-tokens header
    (the probe reserves its own 8 + 1 tokens, taken off again here)."""
    r = await gw.http.post("/v1/completions", headers=gw.auth(key),
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return TPM - int(r.headers["x-ratelimit-remaining-tokens"]) - (len(PROMPT) + 1)


def serve(tmp_path, **settings):
    """The gateway on a fresh PostgreSQL database (or the `database_url` given)."""
    return running_gateway(tmp_path / "gw", "postgresql", models={MODEL: demo_model("llama", "tiny", 0)},
                           engine_kwargs=ENGINE, **settings)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared(tmp_path_factory):
    """One gateway on default settings for the tests that need nothing else: (gateway, db url)."""
    async with serve(tmp_path_factory.mktemp("shared")) as gw:
        yield gw, gw.settings.database_url


async def tenant(gw) -> tuple[dict, str]:
    return await gw.tenant(quota={"tokens_per_minute": TPM})


async def read_stream(gw, key: str, max_chunks: int | None = None, **kw) -> tuple[int, BaseException | None]:
    """Stream a long completion; (completion tokens received, the error the stream ended with)."""
    received = 0
    try:
        stream = await client(gw, key, timeout=30).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2000, stream=True, logprobs=0,
            extra_body={"ignore_eos": True}, **kw)
        async for chunk in stream:
            received += len(chunk.choices[0].logprobs.tokens) if chunk.choices else 0
            if max_chunks is not None and received >= max_chunks:
                await stream.close()
                return received, None
    except openai.APIError as exc:
        return received, exc
    return received, None


async def test_stream_client_gone_row_matches_the_limiter(shared):
    """A client that leaves mid-stream: one `cancelled` row, its prompt and at least the
    completion tokens the client read; the limiter holds exactly what the row says."""
    gw, pg = shared
    t, key = await tenant(gw)
    received, exc = await read_stream(gw, key, max_chunks=5)
    assert exc is None and received >= 5
    [row] = await wait_rows(pg, t["id"], 1)
    assert row["status"] == "cancelled" and row["prompt_tokens"] == len(PROMPT)
    assert received <= row["completion_tokens"] < 2000
    assert await settled_tokens(gw, key) == row["prompt_tokens"] + row["completion_tokens"]


async def test_non_streaming_client_gone_bills_no_completion(shared):
    """A non-streaming client that leaves was sent no completion: its row counts the prompt
    (prefill ran) and 0 completion tokens, and the limiter holds exactly that."""
    gw, pg = shared
    t, key = await tenant(gw)
    with pytest.raises(openai.APITimeoutError):
        await client(gw, key, timeout=0.5).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=2000, extra_body={"ignore_eos": True})
    [row] = await wait_rows(pg, t["id"], 1)
    assert (row["status"], row["prompt_tokens"], row["completion_tokens"]) == ("cancelled", len(PROMPT), 0)
    assert await settled_tokens(gw, key) == len(PROMPT)


async def test_request_timeout_ends_runs_with_an_error_and_a_row(tmp_path):
    """`request_timeout_s` bounds a request end to end: a stream over it ends with an error
    event (`request_timeout`), a JSON request is answered 504; each one row, `cancelled`,
    settled to what the row says."""
    async with serve(tmp_path, request_timeout_s=0.4) as gw:
        pg = gw.settings.database_url
        t, key = await tenant(gw)
        received, exc = await read_stream(gw, key)
        assert isinstance(exc, openai.APIError) and "request_timeout_s" in exc.message, exc
        with pytest.raises(openai.APIStatusError) as err:
            await client(gw, key, timeout=30).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2000, extra_body={"ignore_eos": True})
        assert err.value.status_code == 504 and "request_timeout_s" in err.value.message
        got = sorted(await wait_rows(pg, t["id"], 2), key=lambda r: -r["completion_tokens"])
        assert [r["status"] for r in got] == ["cancelled", "cancelled"]
        assert (got[0]["completion_tokens"], got[1]["completion_tokens"]) == (received, 0)
        assert await settled_tokens(gw, key) == sum(r["prompt_tokens"] + r["completion_tokens"] for r in got)


async def test_client_request_id_is_stored_on_the_usage_row(shared):
    """The client's `x-request-id` is echoed and stored on its usage row."""
    gw, pg = shared
    t, key = await tenant(gw)
    r = await gw.http.post("/v1/completions", headers={**gw.auth(key), "x-request-id": "client-abc-123"},
                           json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-abc-123"
    [row] = await wait_rows(pg, t["id"], 1)
    assert row.get("client_request_id") == "client-abc-123"


async def test_database_down_usage_is_spooled_then_replayed_once(tmp_path):
    """With a PostgreSQL this test stops and restarts: admitted requests, streamed and not,
    are answered in full and billed through the spool; `/ready` says degraded; admin routes
    and keys not in the key cache get 503 `database_unavailable` (what is refused while the
    database is down); once it is back the spooled rows are in it, each exactly once."""
    with throwaway_postgres() as pg:
        async with serve(tmp_path, database_url=pg.url, key_cache_ttl_s=60, database_timeout_s=1,
                         usage_replay_interval_s=0.2) as gw:
            t, key = await tenant(gw)
            oai = client(gw, key, timeout=30)
            await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)   # the key is cached now
            await gw.admin.get("/tenants")                                           # and the admin key
            await asyncio.to_thread(pg.stop)
            stream = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
            *_, last = [chunk async for chunk in stream]
            assert last.usage.completion_tokens == 20
            done = await oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                                extra_body={"ignore_eos": True})
            assert done.usage.completion_tokens == 5
            ready = await gw.http.get("/ready")
            assert ready.status_code == 200, ready.text
            assert ready.json()["status"] == "degraded" and ready.json()["database"] is False
            assert ready.json()["usage_spooled"] == 2
            r = await gw.admin.get("/tenants")
            assert (r.status_code, r.json()["error"]["code"]) == (503, "database_unavailable"), r.text
            with pytest.raises(openai.APIStatusError) as err:          # a key not in the cache
                await client(gw, "lg-" + "x" * 40).models.list()
            assert err.value.status_code == 503 and err.value.code == "database_unavailable"
            await asyncio.to_thread(pg.start)
            deadline = time.monotonic() + 10
            while (await gw.http.get("/ready")).json()["status"] != "ready":
                assert time.monotonic() < deadline, "the spool was not replayed"
                await asyncio.sleep(0.1)
            got = rows(pg.url, t["id"])
            assert sorted(r["completion_tokens"] for r in got) == [2, 5, 20]
            assert len({r["request_id"] for r in got}) == 3 and {r["status"] for r in got} == {"ok"}


# The Responses and Messages streams (their own event loops over the chat path's run): a client
# that leaves mid-stream leaves one row, `cancelled`, with the client's x-request-id on it, and
# the limiter settled to exactly what the row says, as for chat above.
ROUTES = {"responses": ("/v1/responses", {"model": MODEL, "input": "tell me a story", "stream": True},
                        "response.output_text.delta"),
          "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 2000, "stream": True,
                                        "messages": [{"role": "user", "content": "tell me a story"}]},
                       "content_block_delta")}


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_route_stream_client_gone_leaves_one_row_with_its_request_id(shared, route):
    gw, pg = shared
    t, key = await tenant(gw)
    path, body, delta = ROUTES[route]
    headers = {**gw.auth(key), "x-request-id": f"client-{route}-gone"}
    deltas = 0
    async with gw.http.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == f"client-{route}-gone"
        async for line in r.aiter_lines():
            deltas += line.startswith("data: ") and f'"type":"{delta}"' in line
            if deltas == 3:
                break                                   # gone after the third delta
    [row] = await wait_rows(pg, t["id"], 1)
    assert (row["status"], row["client_request_id"]) == ("cancelled", f"client-{route}-gone")
    assert deltas <= row["completion_tokens"] < 64      # the fake engine's answer is 64 tokens
    assert await settled_tokens(gw, key) == row["prompt_tokens"] + row["completion_tokens"]
