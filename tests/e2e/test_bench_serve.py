"""`lockgate bench serve`: its arithmetic on hand-made samples, its schedule, how it classes
each kind of answer (against a scripted in-process server), and a two-rate smoke run against a
live `lockgate serve` on loopback whose outputs are checked: both rates and tiers served,
nothing failed, percentiles in order, the plots written as real PNGs."""

from __future__ import annotations

import asyncio
import csv
import json
import math
import os
import subprocess
import sys
import threading
from itertools import pairwise
from pathlib import Path

import pytest

from lockgate.loadtests.bench_serve import (
    BenchServeError,
    RequestResult,
    ServeConfig,
    arrivals,
    bench_serve,
    chunk_text,
    parse_rates,
    parse_tier_mix,
    step_summary,
    summarize,
)
from tests.support.gateway_server import free_port, running_server
from tests.support.helpers import demo_model

LOCKGATE = str(Path(sys.executable).with_name("lockgate"))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# -- the arithmetic -------------------------------------------------------------------------------
def ok(tier: str, ttft: float, e2e: float, tokens: int, itl: list[float]) -> RequestResult:
    return RequestResult(0, tier, 0.0, status=200, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens, itl_s=itl)


def samples() -> list[RequestResult]:
    return [
        ok("default", 0.1, 0.42, 9, [0.03, 0.05]),    # TPOT 0.32 / 8 = 40 ms: meets both SLOs
        ok("default", 0.2, 1.2, 11, [0.1]),           # TPOT 1.0 / 10 = 100 ms: misses TPOT
        ok("flex", 0.6, 0.7, 3, []),                  # TTFT 600 ms: misses TTFT (TPOT 50 ms)
        ok("flex", 0.3, 0.3, 1, []),                  # one token: no TPOT, TTFT met: good
        RequestResult(0, "flex", 0.0, status=429, error="HTTP 429: busy"),
        RequestResult(0, "default", 0.0, status=503, error="HTTP 503: overloaded"),
        RequestResult(0, "default", 0.0, error="timeout: no end within --timeout"),
    ]


def test_summary_arithmetic_on_hand_made_samples():
    """Over 2 s, SLOs TTFT 500 ms and TPOT 50 ms:
    completed 4 (one 429 refused apart, a 503 and a timeout failed); good: the first and the
    one-token answer, so goodput 2 / 2 s = 1 req/s; output 9 + 11 + 3 + 1 = 24 tokens, 12/s.
    TTFT 100, 200, 300, 600 ms: mean 300, p50 (200 + 300) / 2 = 250, p90 at rank 2.7:
    300 + 0.7 x 300 = 510, p99 at 2.97: 591. TPOT 40, 50, 100 (the one-token answer has
    none): p50 50, p99 at rank 1.98: 50 + 0.98 x 50 = 99. ITL 30, 50, 100: p50 50.
    E2E 300, 420, 700, 1200: p50 560."""
    s = summarize(samples(), 2.0, slo_ttft_ms=500, slo_tpot_ms=50)
    assert (s["requests"], s["completed"], s["refused"], s["failed"]) == (7, 4, 1, 2)
    assert s["failures"] == {"503": 1, "timeout": 1}
    assert s["good"] == 2 and s["goodput"] == pytest.approx(1.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_tokens"] == 24 and s["output_throughput"] == pytest.approx(12.0)
    assert s["ttft_ms"] == pytest.approx({"mean": 300, "p50": 250, "p90": 510, "p99": 591})
    assert s["tpot_ms"]["p50"] == pytest.approx(50) and s["tpot_ms"]["p99"] == pytest.approx(99)
    assert s["itl_ms"]["p50"] == pytest.approx(50)
    assert s["e2e_ms"]["p50"] == pytest.approx(560)
    # looser SLOs: every completed request is good
    assert summarize(samples(), 2.0, slo_ttft_ms=1000, slo_tpot_ms=100)["good"] == 4
    # nothing completed: no percentiles, no NaN in the JSON
    empty = summarize(samples()[4:], 2.0, 500, 50)
    assert empty["completed"] == 0 and empty["ttft_ms"]["p99"] is None
    json.dumps(empty, allow_nan=False)


def test_step_summary_splits_by_tier_and_the_tiers_add_up():
    cfg = ServeConfig(url="http://x", rates=(1.0,), tier_mix=(("default", 1.0), ("flex", 1.0)))
    step = step_summary(cfg, 1.0, samples(), 2.0)
    tiers = step["tiers"]
    assert set(tiers) == {"default", "flex"}
    for key in ("requests", "completed", "refused", "failed", "good", "output_tokens"):
        assert tiers["default"][key] + tiers["flex"][key] == step["all"][key], key
    assert tiers["flex"]["refused"] == 1 and tiers["default"]["failed"] == 2
    assert tiers["flex"]["ttft_ms"]["p50"] == pytest.approx(450)    # (300 + 600) / 2


# -- the schedule ---------------------------------------------------------------------------------
def test_arrivals_are_seeded_poisson_with_the_tier_mix():
    cfg = ServeConfig(url="http://x", rates=(50.0,), tier_mix=parse_tier_mix("default=0.7,flex=0.3"),
                      duration_s=20.0, prompt_words=12)
    plan = arrivals(cfg, 50.0)
    assert plan == arrivals(cfg, 50.0)                       # seeded: the same schedule again
    assert [a.at_s for a in plan] != [a.at_s for a in arrivals(cfg, 51.0)]
    assert 900 <= len(plan) <= 1100                          # 1000 expected; sd about 32
    times = [a.at_s for a in plan]
    assert times == sorted(times) and times[0] > 0 and times[-1] < 20.0
    gaps = [b - a for a, b in pairwise([0.0, *times])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.1)
    cv = math.sqrt(sum((g - 0.02) ** 2 for g in gaps) / len(gaps)) / 0.02
    assert 0.85 < cv < 1.15                                  # exponential gaps: sd equals mean
    assert sum(a.tier == "flex" for a in plan) / len(plan) == pytest.approx(0.3, abs=0.05)
    assert {len(a.prompt.split()) for a in plan} == {12} and len({a.prompt for a in plan}) == len(plan)
    capped = ServeConfig(url="http://x", rates=(50.0,), duration_s=20.0, max_requests=7)
    assert len(arrivals(capped, 50.0)) == 7


def test_argument_parsing():
    assert parse_rates("1, 2.5,4") == (1.0, 2.5, 4.0)
    assert parse_tier_mix("default=0.7,flex=0.3") == (("default", 0.7), ("flex", 0.3))
    assert parse_tier_mix("none") == (("none", 1.0),)
    for bad in ("", "a", "0,1", "-1"):
        with pytest.raises(BenchServeError):
            parse_rates(bad)
    for bad in ("", "default=x", "default=0", "=1"):
        with pytest.raises(BenchServeError):
            parse_tier_mix(bad)
    with pytest.raises(BenchServeError):
        ServeConfig(url="http://x", rates=(1.0,), max_tokens=0)


def test_chunk_text_reads_chat_deltas_and_completion_text():
    assert chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {}, "finish_reason": "length"}]}) == ""
    assert chunk_text({"choices": [{"text": "yo", "index": 0}]}) == "yo"
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


# -- answers of every kind, from a scripted server ------------------------------------------------
def scripted_server():
    """An aiohttp server in a thread; what it answers depends on the request's service_tier:
    default: 3 content chunks 20 ms apart after 50 ms, and a usage chunk saying 5 tokens;
    nousage: the same without the usage chunk; busy: 429; broken: 500; midway: an error event
    in the stream; slow: nothing for 30 s (cut by the step's drain)."""
    from aiohttp import web

    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": "scripted", "object": "model"}]})

    async def chat(request):
        body = await request.json()
        tier = body.get("service_tier", "none")
        if tier == "busy":
            return web.json_response({"error": {"message": "busy"}}, status=429)
        if tier == "broken":
            return web.json_response({"error": {"message": "broken"}}, status=500)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj):
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        if tier == "slow":
            await asyncio.sleep(30)
        await asyncio.sleep(0.05)
        for i in range(3):
            if i:
                await asyncio.sleep(0.02)
            await event({"choices": [{"index": 0, "delta": {"content": f"w{i} "}}]})
            if tier == "midway":
                await event({"error": {"message": "cut"}})
                return resp
        if tier != "nousage":
            await event({"choices": [], "usage": {"completion_tokens": 5}})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
    loop.run_until_complete(runner.setup())
    port = free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def stop():
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def test_every_kind_of_answer_is_measured_or_classed(tmp_path):
    url, stop = scripted_server()
    try:
        mix = parse_tier_mix("default=2,nousage=1,busy=1,broken=1,midway=1,slow=1")
        cfg = ServeConfig(url=url + "/v1", rates=(40.0,), tier_mix=mix, duration_s=1.0, drain_s=0.8,
                          max_tokens=8, seed=3)
        lines: list[str] = []
        report = bench_serve(cfg, tmp_path, echo=lines.append)
    finally:
        stop()
    assert report["model"] == "scripted"
    [step] = report["steps"]
    tiers = step["tiers"]
    assert all(tiers[t]["requests"] > 0 for t in cfg.tiers), {t: tiers[t]["requests"] for t in cfg.tiers}
    d = tiers["default"]
    assert d["completed"] == d["requests"] and d["output_tokens"] == 5 * d["completed"]   # usage counts
    assert 50 <= d["ttft_ms"]["p50"] < 300                                            # the 50 ms wait
    assert 20 <= d["itl_ms"]["p50"] < 200                                             # 20 ms apart
    assert d["tpot_ms"]["p50"] == pytest.approx((d["e2e_ms"]["p50"] - d["ttft_ms"]["p50"]) / 4, rel=0.5)
    assert tiers["nousage"]["output_tokens"] == 3 * tiers["nousage"]["completed"] > 0  # chunks counted
    assert tiers["busy"]["refused"] == tiers["busy"]["requests"] and tiers["busy"]["failed"] == 0
    assert tiers["broken"]["failures"] == {"500": tiers["broken"]["requests"]}
    assert tiers["midway"]["failures"] == {"stream error": tiers["midway"]["requests"]}
    assert tiers["slow"]["failures"] == {"unfinished": tiers["slow"]["requests"]}
    assert step["elapsed_s"] < 1.0 + 0.8 + 1.0                                        # the drain held
    assert step["all"]["refused"] == tiers["busy"]["requests"]
    assert any("busy" in line and "fail" not in line for line in lines)              # a table row
    rows = list(csv.DictReader((tmp_path / "requests.csv").open()))
    assert len(rows) == step["arrivals"]
    assert {r["outcome"] for r in rows if r["tier"] == "busy"} == {"refused"}


# -- the smoke run against lockgate serve ---------------------------------------------------------
def test_bench_serve_two_rates_against_lockgate_serve(tmp_path):
    """Two rates (2 and 4 req/s, 4 s each) of default and flex chats against a live server:
    both steps and both tiers served, nothing failed, the percentiles in order, the outputs
    (JSON, CSV, two PNGs) written."""
    out = tmp_path / "bench"
    with running_server(tmp_path / "srv", "embedded", models={"tiny": demo_model("llama", "tiny", 0)}) as server:
        _, key = server.tenant()
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
        run = subprocess.run(
            [LOCKGATE, "bench", "serve", "--url", server.url, "--api-key", key, "--rates", "2,4",
             "--duration", "4", "--drain", "20", "--tier-mix", "default=0.5,flex=0.5", "--max-tokens", "8",
             "--prompt-tokens", "24", "--timeout", "20", "--out", str(out)],
            capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "TTFT p50/90/99" in run.stdout and "rate 4 req/s" in run.stdout
    report = json.loads((out / "results.json").read_text())
    assert report["model"] == "tiny" and report["tiers"] == ["default", "flex"]
    assert [s["rate"] for s in report["steps"]] == [2, 4]
    for step in report["steps"]:
        assert step["all"]["failed"] == 0, (step["all"]["failures"], step["failure_examples"])
        assert step["all"]["output_throughput"] > 0
        for tier in ("default", "flex"):
            s = step["tiers"][tier]
            assert s["completed"] > 0 and s["failed"] == 0, (tier, s)
            assert s["output_throughput"] > 0 and s["output_tokens"] <= 8 * s["completed"]
            for metric in ("ttft_ms", "itl_ms", "e2e_ms"):
                d = s[metric]
                assert 0 < d["p50"] <= d["p90"] <= d["p99"], (tier, metric, d)
            assert s["ttft_ms"]["p50"] <= s["e2e_ms"]["p50"]
    rows = list(csv.DictReader((out / "requests.csv").open()))
    assert len(rows) == sum(s["arrivals"] for s in report["steps"])
    for name in ("latency_vs_throughput.png", "goodput_vs_rate.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, (name, len(data))
