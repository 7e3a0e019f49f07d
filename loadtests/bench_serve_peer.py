"""`lockgate bench serve --peer vllm`: `lockgate serve --engine-process` (the embedded engine
in a process of its own) against the same server with its engine in process
(`--no-engine-process`, the default) and, where its venv exists (scripts/peer-vllm.sh), `vllm serve`
(vLLM's OpenAI server, its engine core in a process of its own), on vLLM's serving workload:
`num_prompts` random prompts of `input_len` tokens, `output_len` tokens each (ignore_eos),
streamed from `/v1/completions`, first all at once (request rate inf), then `concurrency` at a
time. The same demo model (the small llama of `lockgate bench throughput --peer vllm`) on
each side.

The sides alternate, each in a fresh server process, `repeats` rounds; for each side and
mode the run with the most output tok/s counts (its TPOT from the same run). TTFT from the
send to the first content chunk, TPOT = (e2e - TTFT) / (tokens - 1), output tok/s = output
tokens / (first send to last end). Load goes to 127.0.0.1 only, each request bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import secrets
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockgate.loadtests.harness.server import ServerProcess, free_port
from lockgate.loadtests.stats import percentile

SIDES = ("engine-process", "in-process", "vllm")


@dataclass(slots=True, frozen=True)
class PeerServeSizes:
    num_prompts: int = 200
    input_len: int = 128
    output_len: int = 64
    concurrency: int = 16
    repeats: int = 2
    timeout_s: float = 300.0          # per request
    seed: int = 0


def workload(model_dir: str, s: PeerServeSizes) -> list[list[int]]:
    """Random token prompts (no special tokens), as vLLM's `random` dataset sends them."""
    import random

    from lockgate.engine.config import ModelConfig
    from lockgate.engine.tokenizer import Tokenizer

    cfg = ModelConfig.from_dir(model_dir)
    special = Tokenizer(model_dir).special_token_ids | set(cfg.eos_token_ids)
    allowed = [t for t in range(cfg.vocab_size) if t not in special]
    rng = random.Random(s.seed)
    return [[rng.choice(allowed) for _ in range(s.input_len)] for _ in range(s.num_prompts)]


async def _one(client: Any, url: str, key: str, model: str, ids: list[int], s: PeerServeSizes) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": s.output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    ttft = end - t0 if ttft is None else ttft
    return {"ok": True, "start": t0, "end": end, "ttft": ttft, "tokens": tokens,
            "tpot": (end - t0 - ttft) / (tokens - 1) if tokens > 1 else None}


async def run_load(url: str, key: str, model: str, prompts: list[list[int]], s: PeerServeSizes,
                   concurrency: int | None) -> dict[str, Any]:
    """Every prompt once, all at once (`concurrency` None) or that many at a time."""
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=s.timeout_s, limits=limits) as client:
        await _one(client, url, key, model, prompts[0][:16], s)        # warm up, as vllm bench serve does
        todo = list(enumerate(prompts))
        results: list[dict] = []

        async def worker() -> None:
            while todo:
                _, ids = todo.pop(0)
                try:
                    results.append(await asyncio.wait_for(_one(client, url, key, model, ids, s), s.timeout_s))
                except (TimeoutError, httpx.HTTPError) as exc:
                    results.append({"ok": False, "status": type(exc).__name__})

        await asyncio.gather(*(worker() for _ in range(concurrency or len(prompts))))
    ok = [r for r in results if r["ok"]]
    if not ok:
        return {"completed": 0, "failed": len(results)}
    elapsed = max(r["end"] for r in ok) - min(r["start"] for r in ok)
    tpots = [r["tpot"] * 1000 for r in ok if r["tpot"] is not None]
    ttfts = [r["ttft"] * 1000 for r in ok]
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "output_tok_s": sum(r["tokens"] for r in ok) / elapsed,
            "tpot_ms_p50": percentile(tpots, 50), "tpot_ms_p99": percentile(tpots, 99),
            "ttft_ms_mean": sum(ttfts) / len(ttfts), "ttft_ms_p99": percentile(ttfts, 99)}


class _VllmServer(ServerProcess):
    name = "vllm serve"


def _lockgate(model_dir: str, data_dir: Path, engine_process: bool) -> tuple[ServerProcess, str]:
    """`lockgate serve` on its defaults but the model and the engine's place; a tenant key."""
    import httpx

    admin_key = "lg-" + secrets.token_urlsafe(32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
    env.update({"LOCKGATE_DATA_DIR": str(data_dir), "LOCKGATE_ADMIN_KEY": admin_key, "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"})
    data_dir.mkdir(parents=True, exist_ok=True)
    args = ["--model", f"peer={model_dir}", "--engine-process" if engine_process else "--no-engine-process"]
    srv = ServerProcess.launch(("lockgate.gateway.cli", "serve"), env, data_dir / "serve.log",
                               extra_args=args, timeout=300)
    try:
        with httpx.Client(base_url=srv.url + "/admin/v1", timeout=30,
                          headers={"Authorization": f"Bearer {admin_key}"}) as admin:
            # a tenant's default quota holds 64 requests in flight: the bench sends 200 at once
            t = admin.post("/tenants", json={"name": "bench", "quota": {
                "max_concurrent_requests": 100_000, "requests_per_minute": 1_000_000,
                "tokens_per_minute": 1_000_000_000}})
            t.raise_for_status()
            k = admin.post(f"/tenants/{t.json()['id']}/keys", json={"name": "bench"})
            k.raise_for_status()
            return srv, k.json()["key"]
    except BaseException:
        srv.stop()
        raise


def _vllm(python: Path, model_dir: str, data_dir: Path) -> tuple[ServerProcess, str]:
    """vLLM's OpenAI server (its engine core in a child, vLLM's default), waited for on /health."""
    import httpx

    port = free_port()
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))})
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                                 "--served-model-name", "peer", "--dtype", "float32", "--max-model-len", "512",
                                 "--port", str(port), "--host", "127.0.0.1"],
                                env=env, cwd=data_dir, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    srv = _VllmServer(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{srv.log_excerpt()}")
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    return srv, "none"
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve was not ready within 600 s:\n{srv.log_excerpt()}")
    except BaseException:       # an interrupt too: no server left behind
        srv.stop()
        raise


def bench_serve_peer(model_dir: str | None = None, sizes: PeerServeSizes | None = None,
                     peer_python: Path | None = None, echo=print) -> dict[str, Any]:
    """Run the sides alternating; print each side's best per mode and the ratios."""
    from lockgate.loadtests.bench_throughput import default_model_dir

    s = sizes or PeerServeSizes()
    model_dir = str(model_dir or default_model_dir())
    prompts = workload(model_dir, s)
    sides = [side for side in SIDES if side != "vllm" or peer_python is not None]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="lockgate-bench-serve-peer-") as tmp:
        for r in range(s.repeats):
            for side in sides:
                where = Path(tmp) / f"{side}-{r}"
                if side == "vllm" and peer_python is not None:
                    srv, key = _vllm(peer_python, model_dir, where)
                else:
                    srv, key = _lockgate(model_dir, where, engine_process=side == "engine-process")
                try:
                    inf = asyncio.run(run_load(srv.url, key, "peer", prompts, s, None))
                    conc = asyncio.run(run_load(srv.url, key, "peer", prompts, s, s.concurrency))
                finally:
                    srv.stop()
                runs[side].append({"inf": inf, f"c{s.concurrency}": conc})
                echo(f"round {r + 1} {side}: inf {_line(inf)} | {s.concurrency} concurrent {_line(conc)}")
    return _report(runs, s, echo)


def _line(m: dict) -> str:
    if not m.get("completed"):
        return f"no request completed ({m.get('failed')} failed)"
    return (f"{m['output_tok_s']:,.0f} output tok/s, TPOT p50/p99 {m['tpot_ms_p50']:.1f}/{m['tpot_ms_p99']:.1f} ms, "
            f"TTFT mean {m['ttft_ms_mean']:,.0f} ms" + (f", {m['failed']} failed" if m["failed"] else ""))


def _report(runs: dict[str, list[dict]], s: PeerServeSizes, echo) -> dict[str, Any]:
    modes = ["inf", f"c{s.concurrency}"]
    best = {side: {mode: max((r[mode] for r in rs), key=lambda m: m.get("output_tok_s", 0.0)) for mode in modes}
            for side, rs in runs.items()}
    echo(f"\nbest of {s.repeats}, {s.num_prompts} prompts {s.input_len} -> {s.output_len} on /v1/completions:")
    for side, by_mode in best.items():
        for mode, m in by_mode.items():
            echo(f"  {side:<20} {mode:<4} {_line(m)}")
    ratios: dict[str, dict[str, float]] = {}
    for one, other in (("engine-process", "in-process"), ("engine-process", "vllm"), ("in-process", "vllm")):
        if other not in best:
            continue
        pair = f"{one}/{other}"
        for mode in modes:
            a, b = best[one][mode], best[other][mode]
            if a.get("completed") and b.get("completed"):
                ratios.setdefault(pair, {})[mode] = a["output_tok_s"] / b["output_tok_s"]
                ratios[pair][f"{mode}_tpot_p99"] = a["tpot_ms_p99"] / b["tpot_ms_p99"]
                echo(f"  {one} / {other} at {mode}: {ratios[pair][mode]:.2f}x output tok/s, "
                     f"TPOT p99 {a['tpot_ms_p99']:.1f} vs {b['tpot_ms_p99']:.1f} ms")
    return {"sizes": dataclasses.asdict(s), "runs": runs, "best": best, "ratios": ratios}
