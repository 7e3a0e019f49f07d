"""Grammar bombs against a real `lockgate serve` (embedded, demo model): ten distinct short
patterns whose counted repetitions expand to millions of states, through every field that
takes a pattern. Each is a 400 naming its field (not a 200 abort, not a 500); the process
keeps no memory for them (its RSS is read from /proc), and a second round of the same ten
costs nothing more. A process test because RSS is the point."""

from __future__ import annotations

import time

import httpx
import pytest

from lockgate.loadtests.harness.bombs import BOMB_PATTERNS
from tests.support.gateway_server import GatewayServer

SETTLE_S = 5.0
MAX_GROWTH_MB = 200
MAX_SECOND_ROUND_MB = 50
USER = [{"role": "user", "content": "hi"}]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _body(i: int, pattern: str) -> tuple[dict, str]:
    """The i-th bomb, through one of the three ways a pattern reaches the engine."""
    base = {"model": "tiny", "messages": USER, "max_tokens": 4}
    if i % 3 == 0:
        return {**base, "guided_regex": pattern}, "guided_regex"
    if i % 3 == 1:
        return {**base, "structured_outputs": {"regex": pattern}}, "structured_outputs.regex"
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}, "required": ["v"]}
    return ({**base, "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}},
            "response_format.json_schema.schema")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = GatewayServer.start(tmp_path_factory.mktemp("bomb"))
    try:
        yield srv
    finally:
        srv.stop()


def _round(client: httpx.Client) -> list[tuple[int, str | None, str]]:
    out = []
    for i, pattern in enumerate(BOMB_PATTERNS):
        body, param = _body(i, pattern)
        r = client.post("/v1/chat/completions", json=body)
        err = r.json().get("error", {}) if r.status_code != 200 else {}
        out.append((r.status_code, err.get("param"), param))
    return out


def test_ten_bombs_are_400s_and_keep_no_memory(server):
    _, key = server.tenant()
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {key}"}) as client:
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 2,
                                                       "guided_regex": "(yes|no)"})
        assert r.status_code == 200, r.text       # warm: the tokenizer's trie and a grammar built
        pid = server.proc.pid
        before = _rss_mb(pid)
        first = _round(client)
        assert [(s, p) for s, p, _ in first] == [(400, want) for _, _, want in first], first
        time.sleep(SETTLE_S)
        after_first = _rss_mb(pid)
        second = _round(client)
        assert [(s, p) for s, p, _ in second] == [(400, want) for _, _, want in second], second
        time.sleep(SETTLE_S)
        after_second = _rss_mb(pid)
        # the server still serves a constrained request normally
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "max_tokens": 4,
                                                       "temperature": 0, "guided_choice": ["on", "off"]})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text
    assert after_first - before < MAX_GROWTH_MB, (before, after_first)
    assert after_second - after_first < MAX_SECOND_ROUND_MB, (after_first, after_second)
