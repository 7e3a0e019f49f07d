"""`lockgate bench priority --http`: the promise as a user meets it, through `lockgate serve`
on its defaults (embedded: SQLite, the in-process limiter, the demo model, no knob set).

Two runs, each against a fresh `lockgate serve` process on a loopback port:
1. alone: `default`-tier clients stream chats (Poisson arrivals), nothing else runs;
2. flood: the same, while a `flex` tenant keeps a flood of non-streaming chats outstanding
   (each one that ends is replaced at once).

TTFT is measured by the client: from sending the request to the first content chunk of the
stream. Target: default-tier TTFT p99 under the flood at most 3x its alone value. Load goes
to 127.0.0.1 only, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lockgate.loadtests.harness.server import ServerProcess
from lockgate.loadtests.stats import percentile


@dataclass(slots=True, frozen=True)
class HttpSizes:
    duration_s: float = 30.0          # default-tier arrivals fall in this window
    warmup_s: float = 10.0            # the flood runs alone this long first
    default_rate: float = 2.0         # Poisson arrivals per second
    default_max_tokens: int = 16
    flex_outstanding: int = 24
    flex_max_tokens: int = 128
    flex_words: int = 300             # prompt length of a flex chat, in words
    timeout_s: float = 120.0          # per request
    seed: int = 0


class Serve:
    """`lockgate serve` with nothing configured but a data directory and an admin key, and a
    `chat` and a `batch` tenant with a key each."""

    def __init__(self, data_dir: Path) -> None:
        import httpx

        self.admin_key = "lg-" + secrets.token_urlsafe(32)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
        env.update({"LOCKGATE_DATA_DIR": str(data_dir), "LOCKGATE_ADMIN_KEY": self.admin_key,
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        data_dir.mkdir(parents=True, exist_ok=True)
        self.server = ServerProcess.launch(("lockgate.gateway.cli", "serve"), env, data_dir / "serve.log",
                                           timeout=300)
        self.url = self.server.url
        admin = httpx.Client(base_url=self.url + "/admin/v1", timeout=30,
                             headers={"Authorization": f"Bearer {self.admin_key}"})
        self.keys = {}
        for name in ("chat", "batch"):
            t = admin.post("/tenants", json={"name": name})
            t.raise_for_status()
            k = admin.post(f"/tenants/{t.json()['id']}/keys", json={"name": name})
            k.raise_for_status()
            self.keys[name] = k.json()["key"]
        self.model = httpx.get(self.url + "/v1/models", timeout=10,
                               headers={"Authorization": f"Bearer {self.keys['chat']}"}).json()["data"][0]["id"]
        admin.close()

    def stop(self) -> None:
        self.server.stop()


async def _stream_ttft(client, url: str, key: str, model: str, text: str, max_tokens: int) -> float | None:
    """Seconds to the first content chunk of a streamed default-tier chat; None on failure."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - t0
    return first


async def _run_side(srv: Serve, flood: bool, s: HttpSizes) -> dict[str, Any]:
    import httpx

    rng = random.Random(s.seed)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "light"]
    limits = httpx.Limits(max_connections=s.flex_outstanding + 64)
    stop = asyncio.Event()
    flex_done = {"ok": 0, "refused": 0, "failed": 0}
    async with httpx.AsyncClient(timeout=s.timeout_s, limits=limits) as client:
        async def flex_worker(i: int) -> None:
            wr = random.Random(1000 + i)
            while not stop.is_set():
                text = " ".join(wr.choice(words) for _ in range(s.flex_words))
                body = {"model": srv.model, "messages": [{"role": "user", "content": text}],
                        "max_tokens": s.flex_max_tokens, "temperature": 0, "service_tier": "flex"}
                try:
                    r = await client.post(srv.url + "/v1/chat/completions", json=body,
                                          headers={"Authorization": f"Bearer {srv.keys['batch']}"})
                    # 429 resource_unavailable: the engine's queue is full, flex yields
                    kind = {200: "ok", 429: "refused"}.get(r.status_code, "failed")
                    flex_done[kind] += 1
                    if r.status_code != 200:
                        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                except httpx.HTTPError:
                    flex_done["failed"] += 1

        workers = [asyncio.create_task(flex_worker(i)) for i in range(s.flex_outstanding)] if flood else []
        if flood:
            await asyncio.sleep(s.warmup_s)
        # one warm request so the first measured one pays no one-off cost
        await _stream_ttft(client, srv.url, srv.keys["chat"], srv.model, "hello", 2)
        arrivals, t = [], rng.expovariate(s.default_rate)
        while t < s.duration_s:
            arrivals.append(t)
            t += rng.expovariate(s.default_rate)
        t0 = time.perf_counter()

        async def one(at: float, i: int) -> float | None:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            text = " ".join(random.Random(i).choice(words) for _ in range(12))
            return await _stream_ttft(client, srv.url, srv.keys["chat"], srv.model, text, s.default_max_tokens)

        ttfts = await asyncio.gather(*(one(a, i) for i, a in enumerate(arrivals)))
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    ok = [x for x in ttfts if x is not None]
    return {"flood": flood, "requests": len(ttfts), "failed": len(ttfts) - len(ok),
            "ttft_p50_s": percentile(ok, 50), "ttft_p99_s": percentile(ok, 99),
            "ttft_max_s": max(ok) if ok else float("nan"), "flex": flex_done}


def bench_priority_http(*, sizes: HttpSizes | None = None, echo=print) -> dict[str, Any]:
    s = sizes or HttpSizes()
    echo(f"over HTTP: lockgate serve on its defaults (embedded, the demo model), a fresh process "
         f"per run; default-tier clients stream chats (Poisson {s.default_rate:g}/s over "
         f"{s.duration_s:g} s, max_tokens {s.default_max_tokens}); flood: a flex tenant keeps "
         f"{s.flex_outstanding} chats of ~{s.flex_words} words outstanding (max_tokens "
         f"{s.flex_max_tokens}), {s.warmup_s:g} s before the window")
    results = {}
    for name, flood in (("alone", False), ("flood", True)):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="lockgate-bench-http-") as tmp:
            srv = Serve(Path(tmp) / "data")
            try:
                results[name] = asyncio.run(_run_side(srv, flood, s))
            finally:
                srv.stop()
        echo(f"  {name:<8} done in {time.perf_counter() - t0:5.1f} s")
    alone, flood_r = results["alone"], results["flood"]
    ratio = flood_r["ttft_p99_s"] / alone["ttft_p99_s"]
    holds = ratio <= 3.0 and flood_r["failed"] == 0 and alone["failed"] == 0
    echo("")
    echo(f"{'run':<8}{'TTFT p50':>10}{'TTFT p99':>10}{'max':>8}{'failed':>8}{'flex ok':>9}{'flex 429':>9}")
    for name in ("alone", "flood"):
        r = results[name]
        echo(f"{name:<8}{r['ttft_p50_s'] * 1e3:>10.1f}{r['ttft_p99_s'] * 1e3:>10.1f}"
             f"{r['ttft_max_s'] * 1e3:>8.0f}{r['failed']:>8}{r['flex']['ok']:>9}{r['flex']['refused']:>9}")
    echo(f"default-tier TTFT p99 under the flex flood / alone: {ratio:.2f}x (target <= 3): "
         f"{'holds' if holds else 'DOES NOT HOLD'}")
    return {"sizes": asdict(s), "results": results, "ratio": ratio, "holds": holds}
