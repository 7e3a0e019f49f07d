"""The limiter's own Redis connection (tenancy/limiter/redis_pipe.py) against a real Redis:
pipelined replies reach their callers, cancelled callers do not shift anyone's reply, scripts
come back after SCRIPT FLUSH, a killed connection is opened again, and a Redis that is down
gives a clear ConnectionError (a 503 from the gateway, not a 500, and /ready says so). A Redis
that hangs: tests/tenancy/test_redis_hang.py."""

from __future__ import annotations

import asyncio
import secrets
import subprocess

import httpx
import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from lockgate.tenancy.limiter.redis_pipe import RedisPipe, RedisScript
from tests.support.gateway_server import GatewayServer, free_port


def test_concurrent_commands_each_get_their_own_reply(redis_url):
    async def main():
        pipe = RedisPipe(redis_url)
        replies = await asyncio.gather(*(pipe.execute("ECHO", f"v{i}") for i in range(500)))
        assert replies == [f"v{i}".encode() for i in range(500)]
        assert await pipe.execute("PING") == b"PONG"
        await pipe.aclose()

    asyncio.run(main())


def test_cancelled_callers_do_not_shift_the_replies_of_others(redis_url):
    async def main():
        pipe = RedisPipe(redis_url)
        await pipe.execute("PING")
        tasks = [asyncio.ensure_future(pipe.execute("ECHO", f"v{i}")) for i in range(100)]
        await asyncio.sleep(0)          # all written, none answered yet
        for t in tasks[::2]:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for i, r in enumerate(done):
            if i % 2:
                assert r == f"v{i}".encode()
            else:
                assert isinstance(r, asyncio.CancelledError)
        assert await pipe.execute("ECHO", "after") == b"after"
        await pipe.aclose()

    asyncio.run(main())


def test_error_replies_raise_and_leave_the_connection_usable(redis_url, redis_prefix):
    async def main():
        pipe = RedisPipe(redis_url)
        key = redis_prefix + "s"
        await pipe.execute("SET", key, "text")
        with pytest.raises(ResponseError, match="not an integer"):
            await pipe.execute("INCR", key)
        assert await pipe.execute("GET", key) == b"text"
        await pipe.aclose()

    asyncio.run(main())


def test_scripts_are_sent_again_after_a_flush_and_a_killed_connection_reopens(redis_url, redis_prefix):
    other = redis.Redis.from_url(redis_url)
    name = "lgpipe-" + secrets.token_hex(4)

    async def main():
        pipe = RedisPipe(redis_url)
        script = RedisScript(pipe, "return redis.call('INCRBY', KEYS[1], ARGV[1])")
        key = redis_prefix + "n"
        assert await script([key], [5]) == 5
        other.script_flush()
        assert await script([key], [2]) == 7           # NOSCRIPT, then EVAL: once, not twice
        await pipe.execute("CLIENT", "SETNAME", name)
        killed = other.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        for _ in range(500):                            # until the close reaches us
            if pipe._pipe is None or pipe._pipe.lost is not None:
                break
            await asyncio.sleep(0.01)
        assert await script([key], [1]) == 8           # a new connection, the script still runs
        assert await pipe.execute("CLIENT", "GETNAME") is None   # it is a new connection
        await pipe.aclose()

    try:
        asyncio.run(main())
    finally:
        other.close()


def test_redis_down_is_a_connection_error_naming_the_address():
    port = free_port()

    async def main():
        pipe = RedisPipe(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(RedisConnectionError, match=f"127.0.0.1:{port}"):
            await pipe.execute("PING")

    asyncio.run(main())


def test_the_gateway_answers_503_when_its_redis_is_down(tmp_path):
    port = free_port()
    own = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", str(tmp_path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        srv = GatewayServer.start(tmp_path, redis_url=f"redis://127.0.0.1:{port}/0")
    finally:
        own.terminate()     # ready on it (the limiter reports to /ready), then it goes down
        own.wait(10)
    try:
        _, key = srv.tenant(quota={"requests_per_minute": 100})
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "limiter_unavailable"
        assert r.headers["retry-after"] == "1"
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        ready = httpx.get(srv.url + "/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["limiter"] == "unavailable"
    finally:
        srv.stop()
