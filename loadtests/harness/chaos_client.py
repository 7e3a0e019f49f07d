"""The chaos run's clients: paced, bounded-concurrency requests on the three routes
(`chaos_routes`: chat completions, Responses, Messages, a third each, streamed or not), each
attempt with an `x-request-id` of its own and recorded (`Attempt`), retried on the other
replica when a replica is gone and after a pause when the gateway answers 503 or a
concurrency 429.

Request i is due at t0 + i/rate and runs once a slot of `concurrency` is free; its first
attempt goes to replica i % 2, each retry to the other one; its route is the (i // tenants)-th
in turn, so every tenant sends each route. Past `num_requests`, requests go on at that pace
while the caller says so (the chaos run: until its faults are over). What ends a request:

- a 200 JSON body, or a stream to its route's last event: "ok";
- a stream the client leaves on purpose (`leave_fraction` of streams, after 2 content
  events): "left";
- a 429 `insufficient_quota` (the budget is spent) or any other 4xx: final, not retried;
- `max_attempts` attempts, none "ok": given up.

An attempt's outcome is one of `OUTCOMES`; "ok" attempts must have exactly one usage row,
and so must "left" ones unless their replica was killed before it could write it (the checks
in `chaos_checks`). `long_streams` sends the long streams a kill waits for (`chaos_faults`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from lockgate.loadtests.harness import chaos_routes
from lockgate.loadtests.harness.chaos_routes import ROUTES

OUTCOMES = (
    "ok",            # 200 JSON, or a stream to its route's last event
    "left",          # a 200 stream the client closed on purpose, part way
    "refused",       # an HTTP error status (its code in `error_code`)
    "stream_error",  # a 200 stream that ended with an error event (`response.failed` on Responses)
    "cut",           # a response begun and broken off (the replica died), or no last event
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
    route: str = "chat"          # one of chaos_routes.ROUTES
    server_id: str | None = None  # the server's request id (its lease member, its row's request_id)
    deltas: int = 0              # a stream's content events read
    leave_after: int = 0         # a stream: leave after this many content events (0: read it all)


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
    leave_fraction: float = 0.1      # of streams, left by the client part way
    timeout_s: float = 15.0
    run_id: str = "chaos"
    seed: int = 0


@dataclass
class LoadState:
    """What the fault driver may read while the load runs."""

    attempts: list[Attempt] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=lambda: [0, 0])   # per replica
    last_start: float = 0.0          # time.time() of the latest attempt's start
    open: dict[str, Attempt] = field(default_factory=dict)   # client id -> attempt under way
    run_id: str = "chaos"            # the prefix of the run's client ids
    done: bool = False


def _pause(a: Attempt, resp: httpx.Response | None, number: int) -> float | None:
    """Seconds to wait before the next attempt, or None: the request is over."""
    if a.outcome in ("ok", "left"):
        return None
    if a.outcome == "refused":
        if a.status == 429 and a.error_code != "insufficient_quota":
            after = resp.headers.get("retry-after") if resp is not None else None
            return min(1.0, float(after)) if after and after.replace(".", "", 1).isdigit() else 0.2
        if a.status not in RETRY_STATUSES:
            return None
        return min(1.0, 0.1 * 2 ** number)
    return 0.05       # the replica is gone or broke off: at once, on the other one


async def _attempt(a: Attempt, body: dict, client: httpx.AsyncClient, url: str, key: str,
                   timeout: float, state: LoadState) -> httpx.Response | None:
    state.attempts.append(a)
    state.last_start = a.started
    state.in_flight[a.replica] += 1
    state.open[a.client_id] = a
    try:
        return await chaos_routes.send(a.route, client, url, key, body, a, timeout)
    finally:
        state.in_flight[a.replica] -= 1
        del state.open[a.client_id]
        a.ended = time.time()


async def long_streams(route: str, replica: int, url: str, keys: Sequence[tuple[int, str]],
                       max_tokens: int, run_id: str, state: LoadState, stop: asyncio.Event,
                       timeout: float) -> None:
    """Streams of `max_tokens` on `route` to `replica`, one after another (each tenant of
    `keys`, (tenant, key), in turn; a refusal tried again shortly), until `stop` is set: so
    that one is under way on that route when a kill comes. Recorded as requests of their own
    (negative indices)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=2.0)) as client:
        n = 0
        while not stop.is_set():
            tenant, key = keys[n % len(keys)]
            request = -(len(state.attempts) + 1)
            a = Attempt(request, 0, f"{run_id}-long-{route}-{replica}-{-request:05d}", replica, tenant, True,
                        time.time(), max_tokens=max_tokens, route=route)
            body = chaos_routes.body(route, True, max_tokens, request)
            await _attempt(a, body, client, url, key, timeout, state)
            n += 1
            if a.status != 200 and not stop.is_set():
                await asyncio.sleep(0.1)


async def _request(i: int, plan: LoadPlan, clients: Sequence[httpx.AsyncClient],
                   rng: random.Random, state: LoadState) -> None:
    tenant = i % len(plan.keys)
    route = ROUTES[(i // len(plan.keys)) % len(ROUTES)]
    stream = rng.random() < plan.stream_fraction
    max_tokens = rng.choice(plan.max_tokens)
    leave_after = 2 if stream and rng.random() < plan.leave_fraction else 0
    body = chaos_routes.body(route, stream, max_tokens, i)
    for number in range(plan.max_attempts):
        replica = (i + number) % len(plan.urls)
        a = Attempt(i, number, f"{plan.run_id}-{i:05d}-{number}", replica, tenant, stream,
                    time.time(), max_tokens=max_tokens, route=route, leave_after=leave_after)
        resp = await _attempt(a, body, clients[replica], plan.urls[replica], plan.keys[tenant][replica],
                              plan.timeout_s, state)
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
