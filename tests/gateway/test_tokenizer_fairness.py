"""The tokenizer's worker pool, shared between tenants through the routes (the gateway in
process, its real pool, the fake engine):

- one tenant's backlog of large prompts never makes another tenant's prompt `tokenizer_busy`:
  the pool's queue is served tenant by tenant in turn, and a full queue sheds the newest job
  of the tenant holding the most, never a job of one holding fewer;
- a prompt that cannot fit the model's context whatever its tokens turn out to be (its UTF-8
  bytes over what `max_model_len` tokens can stand for) is refused 400
  `context_length_exceeded` before it reaches the pool.

Before: tenant A's 30 looping 1 MB chats (each a 400 after a second of tokenizing) kept the
pool's 17 places full, and tenant B's 10,000-character chats were refused 503
`tokenizer_busy` 9 times in 12.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ProcessPoolExecutor

import pytest
import pytest_asyncio

from tests.support.inprocess_gateway import running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tmp_path_factory):
    async with running_gateway(tmp_path_factory.mktemp("fair"), "embedded", engine="fake",
                               max_body_bytes=4 << 20, max_prompt_chars=4 << 20,
                               # B's chats (2,500 characters: they fit the demo model's context)
                               # go to the pool too
                               tokenizer_inline_chars=2_000) as gw:
        yield gw


@pytest.fixture
def submissions(monkeypatch) -> list[int]:
    """One entry per job handed to a tokenizer worker process."""
    made: list[int] = []
    real = ProcessPoolExecutor.submit

    def counted(self, fn, /, *args, **kwargs):
        made.append(1)
        return real(self, fn, *args, **kwargs)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", counted)
    return made


def chat(chars: int) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "word " * (chars // 5)}],
            "max_tokens": 4}


async def post(gateway, key: str, body: dict, path: str = "/v1/chat/completions"):
    return await gateway.http.post(path, content=json.dumps(body).encode(),
                                   headers={**gateway.auth(key), "Content-Type": "application/json"})


async def test_one_tenants_backlog_never_makes_anothers_prompt_busy(gateway, submissions):
    _, key_a = await gateway.tenant()
    _, key_b = await gateway.tenant()
    assert (await post(gateway, key_b, chat(2_500))).status_code == 200   # the worker is up
    a_codes: list[str] = []
    stop = asyncio.Event()

    async def flood() -> None:
        while not stop.is_set():     # long to tokenize (~0.05 s), too long to fit: a 400
            r = await post(gateway, key_a, chat(40_000))
            a_codes.append(r.json()["error"]["code"])
            await asyncio.sleep(0.05)         # a busy answer comes at once: no spinning on it

    floods = [asyncio.ensure_future(flood()) for _ in range(30)]
    try:
        while len(a_codes) < 30:         # A's backlog has filled the pool's queue
            await asyncio.sleep(0.05)
        b = [await post(gateway, key_b, chat(2_500)) for _ in range(12)]
    finally:
        stop.set()
        await asyncio.gather(*floods)
    b_codes = [r.json()["error"]["code"] if r.status_code != 200 else "ok" for r in b]
    assert b_codes == ["ok"] * 12, b_codes
    assert set(a_codes) <= {"context_length_exceeded", "tokenizer_busy"}
    assert "tokenizer_busy" in a_codes        # the flood really overflowed the pool
    assert len(submissions) >= len(b) + a_codes.count("context_length_exceeded")


async def test_a_prompt_that_can_never_fit_is_refused_before_the_pool(gateway, submissions):
    _, key = await gateway.tenant()
    r = await post(gateway, key, chat(1_000_000))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"
    r = await post(gateway, key, {"model": "tiny", "prompt": "word " * 200_000, "max_tokens": 4},
                   "/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt"
    assert submissions == []
    # /tokenize counts any prompt's tokens, however long: it still goes to the pool
    r = await post(gateway, key, {"model": "tiny", "prompt": "word " * 20_000}, "/tokenize")
    assert r.status_code == 200 and r.json()["count"] > r.json()["max_model_len"], r.text
    assert submissions == [1]
