"""Usage rows when `lockgate serve` is stopped (SIGTERM, the process's own signal handling
is what is tested): streams still running past `shutdown_timeout_s` end with an error
event, and each has exactly one usage row, written before the usage writer closed. (Usage
rows of requests that end early otherwise, in process: test_usage_durability.py.)"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import psycopg
import pytest

from tests.support.gateway_server import GatewayServer
from tests.support.helpers import demo_model
from tests.support.services import fresh_pg_database

MODEL = "tiny"
TPM = 1_000_000
PROMPT = [100 + j for j in range(8)]     # 8 token ids, none special


def rows(url: str, tenant_id: str) -> list[dict]:
    with psycopg.connect(url.replace("postgresql+asyncpg", "postgresql"), connect_timeout=3) as conn:
        cur = conn.execute("SELECT * FROM usage_records WHERE tenant_id = %s", (tenant_id,))
        names = [d.name for d in cur.description]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def client(srv: GatewayServer, key: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, **kw)


@pytest.fixture
def pg(tmp_path):
    with fresh_pg_database() as url:
        yield url


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
    """Streams still running when `shutdown_timeout_s` runs out end with an error
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
