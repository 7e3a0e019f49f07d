"""The open-loop load generator: request i is due at t0 + i/rate whatever happened before;
non-streaming chat completions over aiohttp's kept-alive pool, in this process or in `n`
client processes that each send rate/n."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import multiprocessing as mp
import time
from collections import Counter
from typing import Any

# the request every generator sends (and the gateway bench's direct baseline submits)
MODEL_NAME = "bench"
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Say hello to the gateway benchmark, briefly."}]
BODY = json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": MAX_TOKENS}).encode()


def freeze_heap() -> None:
    """Before a timed step: what exists now (the imports: torch, transformers) is frozen, so
    the cyclic GC's full collections over that heap (a large pause each) do not stall the
    schedule."""
    gc.collect()
    gc.freeze()


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:   # pragma: no cover - uvicorn[standard] brings it
        return asyncio.new_event_loop()


def run_loop(coro: Any) -> Any:
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro)


async def open_loop(call, rate: float, n: int, t0: float, offset: float = 0.0) -> dict[str, Any]:
    """Fire `call()` n times, the i-th due at t0 + offset + i/rate (perf_counter clock), never
    waiting for earlier ones. `call` returns None for success or a short error string."""
    lat = [math.nan] * n      # send -> full response, successes only
    lag = [math.nan] * n      # how late the send was against its schedule
    done = [math.nan] * n     # completion time, from t0
    sent = [math.nan] * n     # send time, from t0
    errors: Counter[str] = Counter()
    examples: list[str] = []
    clock = time.perf_counter

    async def one(i: int, due: float) -> None:
        ts = clock()
        lag[i] = ts - due
        sent[i] = ts - t0
        try:
            err = await call()
        except Exception as exc:  # noqa: BLE001 - counted, the run goes on
            err = f"{type(exc).__name__}: {exc}"[:200]
        te = clock()
        done[i] = te - t0
        if err is None:
            lat[i] = te - ts
        else:
            errors[err.split(":", 1)[0]] += 1
            if len(examples) < 5:
                examples.append(err)

    tasks = []
    create = asyncio.get_running_loop().create_task
    cpu0 = time.process_time()
    for i in range(n):
        due = t0 + offset + i / rate
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(create(one(i, due)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=60)
        for t in pending:
            t.cancel()
        if pending:
            errors["timeout"] += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
    cpu = time.process_time() - cpu0
    return {"lat": lat, "lag": lag, "done": done, "sent": sent, "errors": dict(errors), "examples": examples,
            "cpu_s": cpu}


def gateway_call(session: Any, key: str):
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}

    async def call() -> str | None:
        async with session.post("/v1/chat/completions", data=BODY, headers=headers) as r:
            content = await r.read()
            if r.status != 200:
                return f"HTTP {r.status}: {content[:160].decode(errors='replace')}"
        if b'"chat.completion"' not in content:
            return f"bad body: {content[:160].decode(errors='replace')}"
        return None

    return call


# The client is aiohttp: its C parser and lean connection pool make the HTTP floor and the
# generator's CPU a fraction of httpx's: what the client spends is not the gateway's latency,
# and on a small machine the client's CPU is taken from the gateway.
MAX_CONNECTIONS = 256


async def http_step(url: str, key: str, rate: float, n: int, start_wall: float | None,
                    offset: float, prime: int) -> dict[str, Any]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as session:
        call = gateway_call(session, key)
        # open `prime` connections before the clock starts (they are not measured)
        primed = await asyncio.gather(*(call() for _ in range(prime)), return_exceptions=True)
        prime_ok = sum(1 for p in primed if p is None)
        freeze_heap()
        # start at once, or at the wall-clock moment every client process shares
        t0 = time.perf_counter() + (0.05 if start_wall is None else start_wall - time.time())
        out = await open_loop(call, rate, n, t0, offset)
    out["prime_ok"] = prime_ok
    return out


def client_step(cfg: dict[str, Any]) -> dict[str, Any]:
    """One client's share of one step, in a fresh event loop (uvloop) and a fresh pool."""
    return run_loop(http_step(cfg["url"], cfg["key"], cfg["rate"], cfg["n"], cfg.get("start_wall"),
                           cfg.get("offset", 0.0), cfg.get("prime", 16)))


def _client_worker(conn: Any) -> None:
    """A client process: runs the steps it is sent until it is sent None."""
    while True:
        cfg = conn.recv()
        if cfg is None:
            return
        try:
            conn.send(client_step(cfg))
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            conn.send({"failed": repr(exc)})


class Clients:
    """`n` client processes kept for the whole run (one pipe each: one share each per step),
    or the benchmark's own process when n == 1."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.procs: list[Any] = []
        self.pipes: list[Any] = []
        if n > 1:
            ctx = mp.get_context("spawn")
            for _ in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_client_worker, args=(child,), daemon=True)
                p.start()
                self.procs.append(p)
                self.pipes.append(parent)

    def step(self, url: str, key: str, rate: float, duration: float, prime: int = 16) -> dict:
        total = max(1, round(rate * duration))
        if self.n == 1:
            return client_step({"url": url, "key": key, "rate": rate, "n": total, "prime": prime})
        start_wall = time.time() + 2.0       # time for every process to open its pool
        shares = [total // self.n + (1 if i < total % self.n else 0) for i in range(self.n)]
        for i, pipe in enumerate(self.pipes):
            pipe.send({"url": url, "key": key, "rate": rate / self.n, "n": shares[i],
                       "start_wall": start_wall, "offset": i / rate,
                       "prime": max(2, prime // self.n)})
        parts = [pipe.recv() for pipe in self.pipes]
        failed = [p["failed"] for p in parts if "failed" in p]
        if failed:
            raise RuntimeError(f"a client process failed: {failed[0]}")
        merged: dict[str, Any] = {"lat": [], "lag": [], "done": [], "sent": [], "errors": Counter(),
                                  "examples": [], "cpu_s": 0.0, "prime_ok": 0}
        for p in parts:
            for k in ("lat", "lag", "done", "sent", "examples"):
                merged[k] += p[k]
            merged["errors"].update(p["errors"])
            merged["cpu_s"] += p["cpu_s"]
            merged["prime_ok"] += p["prime_ok"]
        merged["errors"] = dict(merged["errors"])
        return merged

    def close(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(None)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


