"""One tenant's burst against a replica with a real Redis: its own limits refuse it (429),
never the replica's event loop (a 503 `limiter_unavailable` to everyone).

A process of its own (tests/support/fake_engine_server.py: the app on the fake engine, its
tokens paced, so every stream holds its admission for seconds; SQLite and Redis under a
prefix of its own), with default settings: the point is its event loop, kept busy by the
flood. Tenant A opens 300 streams at once; tenant B, meanwhile, chats.

Before: nothing bounded a tenant whose plan sets no concurrency, so all of A's streams were
admitted; the loop fell seconds behind, replies Redis had sent within milliseconds sat
unread past the limiter's 0.25 s timeout, and Redis was declared dead: 503s for both
tenants (597 of 1,500 of A's, 11 of B's 60). Now a tenant's concurrency defaults to
`default_max_concurrent_requests` and is checked on this replica before Redis is asked,
the replica bounds the admissions it has under way, and the limiter's timeout counts the
time Redis is silent, not the loop's backlog.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections import Counter

import httpx
import pytest

from tests.support.gateway_server import GatewayServer
from tests.support.helpers import demo_model
from tests.support.services import check_redis, drop_redis_prefix

FLOOD = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("flood")
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    admin_key = "lg-" + secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
    env.update({"LOCKGATE_DATA_DIR": str(data_dir), "LOCKGATE_ADMIN_KEY": admin_key,
                "LOCKGATE_REDIS_URL": check_redis(), "LOCKGATE_REDIS_PREFIX": prefix,
                "LOCKGATE_MODELS": json.dumps([f"tiny={demo_model()}"]),
                "FAKE_ENGINE_TOKEN_INTERVAL_S": "0.02", "PYTHONUNBUFFERED": "1"})
    srv = GatewayServer.launch(("tests.support.fake_engine_server",), env, data_dir / "server.log",
                               fields={"admin_key": admin_key, "data_dir": data_dir, "env": env})
    try:
        yield srv
    finally:
        srv.stop()
        drop_redis_prefix(prefix)


def outcome(status: int, body: bytes) -> str:
    if status == 200:
        return "200"
    try:
        return f"{status} {json.loads(body)['error']['code']}"
    except (ValueError, KeyError, TypeError):
        return f"{status} ?"


async def test_a_burst_meets_its_own_limits_and_another_tenant_never_sees_a_503(server):
    _, key_a = server.tenant()
    _, key_b = server.tenant()
    stream = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 100,
              "ignore_eos": True, "stream": True}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    limits = httpx.Limits(max_connections=FLOOD + 50, max_keepalive_connections=FLOOD + 50)
    a_outcomes: list[str] = []              # in the order they were answered
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as http:

        async def a_stream() -> None:
            async with http.stream("POST", "/v1/chat/completions", json=stream,
                                   headers={"Authorization": f"Bearer {key_a}"}) as r:
                a_outcomes.append(outcome(r.status_code, await r.aread()))

        async def b_chats() -> list[str]:
            out = []
            for _ in range(20):
                r = await http.post("/v1/chat/completions", json=chat,
                                    headers={"Authorization": f"Bearer {key_b}"})
                out.append(outcome(r.status_code, r.content))
                await asyncio.sleep(0.05)
            return out

        flood = [asyncio.ensure_future(a_stream()) for _ in range(FLOOD)]
        b_outcomes = await b_chats()
        await asyncio.gather(*flood)
    a_counts, b_counts = Counter(a_outcomes), Counter(b_outcomes)
    assert not [o for o in b_outcomes if o.startswith("503")], b_counts
    assert b_counts["200"] == len(b_outcomes), b_counts
    assert a_counts["429 rate_limit_exceeded"] > 0, a_counts       # its own concurrency
    assert a_counts["200"] > 0, a_counts
    first_503 = next((i for i, o in enumerate(a_outcomes) if o.startswith("503")), len(a_outcomes))
    assert a_outcomes.index("429 rate_limit_exceeded") < first_503, a_counts
    assert "limiter_unavailable" not in server.log()
