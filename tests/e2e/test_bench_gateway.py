"""`lockgate bench gateway` and its instant engine.

- the command runs end to end against the local PostgreSQL and Redis (a 2-second step at
  50 req/s), writes sane JSON and cleans up after itself; it refuses clearly when a service
  does not answer;
- InstantEngine does what AsyncEngine does for the gateway: the same calls, the same output
  shapes, the same errors, close() aborting an unfinished request (each behaviour is checked
  on both engines).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockgate.engine import (
    AsyncEngine,
    CompletionOutput,
    EngineDead,
    PromptTooLong,
    RequestMetrics,
    RequestOutput,
    RequestStream,
    SamplingParams,
)
from lockgate.loadtests.instant_engine import InstantEngine
from tests.support.helpers import demo_model
from tests.support.services import PG_ADMIN_DB, PG_HOST, PG_PORT, PG_USER, _missing, _pg_admin

LOCKGATE = str(Path(sys.executable).with_name("lockgate"))
ADMIN_URL = f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{PG_ADMIN_DB}"


def lockgate(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run([LOCKGATE, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def pg_admin_url():
    """The PostgreSQL database the benchmark makes its scratch database from (after a check)."""
    try:
        with _pg_admin() as conn:
            conn.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001
        _missing(f"PostgreSQL at {PG_HOST}:{PG_PORT}", exc)
    return ADMIN_URL


# -- the command ------------------------------------------------------------------------------------
def test_bench_gateway_smoke_run_writes_sane_json_and_cleans_up(tmp_path, pg_admin_url, redis_url):
    out = tmp_path / "out.json"
    res = lockgate("bench", "gateway", "--rates", "50", "--duration", "2", "--json", str(out),
                   "--database-url", pg_admin_url, "--redis-url", redis_url)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "added latency at 50 req/s, p50" in res.stdout
    assert "highest rate held with p99 < 25 ms" in res.stdout
    report = json.loads(out.read_text())
    [step] = report["rates"]
    assert step["target_rps"] == 50
    assert 35 <= step["achieved_rps"] <= 65, step
    assert step["errors"] == 0, step["error_examples"]
    assert step["requests"] == step["ok"] == 100
    assert 0 < step["p50_ms"] <= step["p99_ms"]
    assert 0 < step["direct_p50_ms"] <= step["direct_p99_ms"]
    assert step["added_p50_ms"] == pytest.approx(step["p50_ms"] - step["direct_p50_ms"])
    assert step["added_p99_ms"] == pytest.approx(step["p99_ms"] - step["direct_p99_ms"])
    assert step["lag_p99_ms"] >= 0 and step["client_cpu"] >= 0 and step["server_cpu"] >= 0
    ref = report["reference"]
    assert ref["rate"] == 50 and ref["added_p50_ms"] == step["added_p50_ms"]
    assert report["floor"]["errors"] == 0 and report["floor"]["p50_ms"] > 0
    # every answered request has its usage row; the limiter kept keys in Redis
    assert report["usage_rows"] == report["ok_responses"] >= 100
    assert report["redis_keys"] > 0
    # and nothing is left behind
    with _pg_admin() as conn:
        left = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s",
                            (report["database"],)).fetchone()[0]
    assert left == 0
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        assert not list(client.scan_iter(match=report["redis_prefix"] + "*"))
    finally:
        client.close()


def test_bench_gateway_says_which_service_is_unreachable(pg_admin_url):
    res = lockgate("bench", "gateway", "--rates", "50", "--duration", "1",
                   "--database-url", f"postgresql://{PG_USER}@127.0.0.1:1/test", timeout=60)
    assert res.returncode == 2
    assert "PostgreSQL" in res.stderr and "not reachable" in res.stderr
    res = lockgate("bench", "gateway", "--rates", "50", "--duration", "1",
                   "--database-url", pg_admin_url, "--redis-url", "redis://127.0.0.1:1/0", timeout=60)
    assert res.returncode == 2
    assert "Redis" in res.stderr and "not reachable" in res.stderr


# -- InstantEngine vs AsyncEngine --------------------------------------------------------------------
ENGINES = {"instant": InstantEngine,
           "async": lambda d: AsyncEngine(d, kv_cache_memory=16 << 20, max_num_seqs=8)}


@pytest.mark.parametrize("kind", list(ENGINES))
def test_instant_engine_behaves_like_async_engine_for_the_gateway(kind):
    d = demo_model("llama")

    async def main():
        engine = ENGINES[kind](d)
        assert not engine.is_ready
        with pytest.raises(RuntimeError):
            _ = engine.tokenizer
        await engine.start()
        try:
            assert engine.is_ready
            tok = engine.tokenizer
            assert tok.vocab_size > 0 and tok.hf_tokenizer is not None
            text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}])
            ids = tok.encode(text, add_special_tokens=False)
            assert engine.max_model_len > len(ids)
            engine.set_tenant_weight("t1", 2.0)
            assert engine.tenant_weights == {"t1": 2.0}
            with pytest.raises(ValueError):
                engine.set_tenant_weight("t1", 0)
            assert {"running", "waiting_requests", "kv", "num_preemptions"} <= set(engine.stats().to_dict())

            # submit + iterate: cumulative outputs, the last one finished, with metrics
            kw = dict(tenant="t1", service_class="online", priority=0, cache_salt="t1:")
            stream = engine.submit(ids, SamplingParams(max_tokens=8, ignore_eos=True), "r1", **kw)
            assert isinstance(stream, RequestStream)
            outs = [o async for o in stream]
            stream.close()
            stream.close()     # idempotent
            final = outs[-1]
            assert all(isinstance(o, RequestOutput) for o in outs)
            assert final.finished and not any(o.finished for o in outs[:-1])
            c = final.outputs[0]
            assert isinstance(c, CompletionOutput) and isinstance(final.metrics, RequestMetrics)
            assert len(c.token_ids) == 8 and c.finish_reason == "length"
            assert "".join(o.outputs[0].delta_text for o in outs) == c.text == tok.decode(c.token_ids)
            assert final.prompt_token_ids == ids
            assert final.metrics.first_token_time and final.metrics.finished_time

            # what the gateway renders from logprobs works on its outputs
            from lockgate.gateway.responses import chat_logprobs

            stream = engine.submit(ids, SamplingParams(max_tokens=3, n=2, logprobs=2), "r2", **kw)
            final = [o async for o in stream][-1]
            stream.close()
            assert [c.index for c in final.outputs] == [0, 1]
            lp = chat_logprobs(final.outputs[0], 0, 2)
            assert len(lp["content"]) == len(final.outputs[0].token_ids)
            assert all(len(e["top_logprobs"]) == 2 for e in lp["content"])

            # refused before anything is queued
            with pytest.raises(ValueError):
                engine.submit([], SamplingParams(max_tokens=4), "r3", **kw)
            with pytest.raises(ValueError):
                engine.submit([tok.vocab_size + 5], SamplingParams(max_tokens=4), "r3", **kw)
            with pytest.raises(PromptTooLong):
                engine.submit([ids[0]] * engine.max_model_len, SamplingParams(max_tokens=4), "r3", **kw)
            held = engine.submit(ids, SamplingParams(max_tokens=64, ignore_eos=True), "r4", **kw)
            with pytest.raises(ValueError):
                engine.submit(ids, SamplingParams(max_tokens=4), "r4", **kw)   # id in use

            # close() before the end aborts the request: it leaves the engine
            first = await held.__anext__()
            assert not first.finished
            held.close()
            assert [o async for o in held] == []
            for _ in range(200):
                if engine.stats().num_requests == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().num_requests == 0
            again = engine.submit(ids, SamplingParams(max_tokens=2), "r4", **kw)   # id free again
            assert [o async for o in again][-1].finished
            again.close()
        finally:
            await engine.shutdown()
        with pytest.raises(EngineDead):
            engine.submit(ids, SamplingParams(max_tokens=2), "r5", **kw)

    asyncio.run(main())


def test_instant_engine_caps_its_answer_and_counts_aborts():
    d = demo_model("llama")

    async def main():
        async with InstantEngine(d, max_output_tokens=16) as engine:
            ids = engine.tokenizer.encode("hello", add_special_tokens=False)
            outs = [o async for o in engine.generate(ids, SamplingParams(max_tokens=100), "a")]
            c = outs[-1].outputs[0]
            assert len(outs) == 16 and len(c.token_ids) == 16 and c.finish_reason == "stop"
            stream = engine.submit(ids, SamplingParams(max_tokens=8), "b")
            stream.close()
            assert engine.num_aborted == 1 and engine.num_finished == 1
            open_stream = engine.submit(ids, SamplingParams(max_tokens=8), "c")
        # shut down with a stream open: its reader gets EngineDead, as from AsyncEngine
        with pytest.raises(EngineDead):
            await open_stream.__anext__()

    asyncio.run(main())
