"""The chaos run's clients: paced, bounded-concurrency chat completions over httpx, each
attempt with an `x-request-id` of its own and recorded (`Attempt`), retried on the other
replica when a replica is gone and after a pause when the gateway answers 503 or a
concurrency 429.

Request i is due at t0 + i/rate and runs once a slot of `concurrency` is free; its first
attempt goes to replica i % 2, each retry to the other one. Past `num_requests`, requests go
on at that pace while the caller says so (the chaos run: until its faults are over). What ends a request:

- a 200 JSON body, or a stream that ended with `data: [DONE]`: "ok";
- a 429 `insufficient_quota` (the budget is spent) or any other 4xx: final, not retried;
- `max_attempts` attempts, none "ok": given up.

An attempt's outcome is one of `OUTCOMES`; only "ok" attempts must have a usage row (the
checks in `chaos_checks`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

OUTCOMES = (
    "ok",            # 200 JSON, or a stream ending with [DONE]
    "refused",       # an HTTP error status (its code in `error_code`)
    "stream_error",  # a 200 stream that ended with a data: {"error": ...} event
    "cut",           # a response begun and broken off (the replica died), or no [DONE]
    "unreachable",   # no response: connection refused or reset before any answer
    "timeout",       # the client's timeout passed
)
RETRY_STATUSES = (503, 502, 504)


@dataclass(slots=True)
class Attempt:
    request: int                 # the logical request's index
    number: int                  # 0 for the first attempt
    client_id: str               # the x-request-id sent
    replica: int
    tenant: int
    stream: bool
    started: float               # time.time()
    ended: float = 0.0
    status: int | None = None    # the HTTP status, when one came back
    outcome: str = "unreachable"
    error_code: str | None = None
    usage: tuple[int, int] | None = None   # (prompt, completion) as the client was told
    max_tokens: int = 0          # asked for


@dataclass(slots=True)
class LoadPlan:
    num_requests: int
    rate: float                      # requests started per second, at most
    concurrency: int
    keys: Sequence[Sequence[str]]    # keys[tenant][replica]: each replica its own key
    urls: Sequence[str]              # one per replica
    max_tokens: Sequence[int] = (8, 16, 32, 64)
    stream_fraction: float = 0.5
    max_attempts: int = 6
    timeout_s: float = 15.0
    run_id: str = "chaos"
    seed: int = 0


@dataclass
class LoadState:
    """What the fault driver may read while the load runs."""

    attempts: list[Attempt] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=lambda: [0, 0])   # per replica
    last_start: float = 0.0          # time.time() of the latest attempt's start
    done: bool = False


def _body(stream: bool, max_tokens: int, i: int) -> dict:
    body: dict = {"model": "tiny", "max_tokens": max_tokens, "stream": stream,
                  "messages": [{"role": "user", "content": f"chaos request {i}: tell me a story"}]}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _error_code(resp: httpx.Response, text: str) -> str | None:
    try:
        return json.loads(text)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def _read_stream(resp: httpx.Response, a: Attempt) -> None:
    """Read an SSE body to its end: "ok" once `[DONE]` came, "stream_error" on an error event,
    "cut" if it ends without either."""
    a.outcome = "cut"
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            a.outcome = "ok"
            return
        event = json.loads(data)
        if "error" in event:
            a.outcome, a.error_code = "stream_error", event["error"].get("code")
            return
        if event.get("usage"):
            a.usage = (event["usage"]["prompt_tokens"], event["usage"]["completion_tokens"])


async def _send(client: httpx.AsyncClient, url: str, key: str, body: dict, a: Attempt,
                timeout: float) -> httpx.Response | None:
    """One attempt, recorded in `a`; the response of an HTTP error (to read Retry-After)."""
    headers = {"Authorization": f"Bearer {key}", "x-request-id": a.client_id}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/chat/completions", json=body,
                                     headers=headers) as resp:
                a.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    a.outcome, a.error_code = "refused", _error_code(resp, text)
                    return resp
                if body["stream"]:
                    await _read_stream(resp, a)
                else:
                    data = json.loads(await resp.aread())
                    a.usage = (data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"])
                    a.outcome = "ok"
    except (httpx.ConnectError, httpx.ConnectTimeout):
        a.outcome = "unreachable"
    except (TimeoutError, httpx.TimeoutException):
        a.outcome = "timeout"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError):
        # the connection broke: before the status line (unreachable) or after it (cut)
        a.outcome = "unreachable" if a.status is None else "cut"
    return None


def _pause(a: Attempt, resp: httpx.Response | None, number: int) -> float | None:
    """Seconds to wait before the next attempt, or None: the request is over."""
    if a.outcome == "ok":
        return None
    if a.outcome == "refused":
        if a.status == 429 and a.error_code != "insufficient_quota":
            after = resp.headers.get("retry-after") if resp is not None else None
            return min(1.0, float(after)) if after and after.replace(".", "", 1).isdigit() else 0.2
        if a.status not in RETRY_STATUSES:
            return None
        return min(1.0, 0.1 * 2 ** number)
    return 0.05       # the replica is gone or broke off: at once, on the other one


async def _request(i: int, plan: LoadPlan, clients: Sequence[httpx.AsyncClient],
                   rng: random.Random, state: LoadState) -> None:
    tenant = i % len(plan.keys)
    stream = rng.random() < plan.stream_fraction
    max_tokens = rng.choice(plan.max_tokens)
    body = _body(stream, max_tokens, i)
    for number in range(plan.max_attempts):
        replica = (i + number) % len(plan.urls)
        a = Attempt(i, number, f"{plan.run_id}-{i:05d}-{number}", replica, tenant, stream,
                    time.time(), max_tokens=max_tokens)
        state.attempts.append(a)
        state.last_start = a.started
        state.in_flight[replica] += 1
        try:
            resp = await _send(clients[replica], plan.urls[replica], plan.keys[tenant][replica],
                               body, a, plan.timeout_s)
        finally:
            state.in_flight[replica] -= 1
            a.ended = time.time()
        pause = _pause(a, resp, number)
        if pause is None:
            return
        await asyncio.sleep(pause)


async def run_load(plan: LoadPlan, state: LoadState, on_start: Callable[[float], None] | None = None,
                   more: Callable[[], bool] | None = None) -> None:
    """Send every request of `plan`, paced and bounded, and then, at the same pace, more while
    `more()` says so; attempts land in `state.attempts`."""
    slots = asyncio.Semaphore(plan.concurrency)
    limits = httpx.Limits(max_connections=plan.concurrency, max_keepalive_connections=plan.concurrency)
    timeout = httpx.Timeout(plan.timeout_s, connect=2.0)
    clients = [httpx.AsyncClient(timeout=timeout, limits=limits) for _ in plan.urls]
    t0 = time.monotonic()
    if on_start is not None:
        on_start(time.time())

    async def one(i: int) -> None:
        async with slots:
            await _request(i, plan, clients, random.Random(plan.seed * 1_000_003 + i), state)

    tasks = []
    try:
        i = 0
        while i < plan.num_requests or (more is not None and more()):
            await asyncio.sleep(max(0.0, t0 + i / plan.rate - time.monotonic()))
            await slots.acquire()      # no request is due while all slots are busy
            slots.release()
            tasks.append(asyncio.create_task(one(i)))
            i += 1
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        for c in clients:
            await c.aclose()
        state.done = True
