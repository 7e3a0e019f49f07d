"""After a flood of large bodies ends, the server's resident size comes back near where it
started (glibc keeps freed pages otherwise: before, 200 one-megabyte prompts twice left a
`lockgate serve` 250 MB above its start for good). A real process: its RSS is the point.
The tenant's own limits let the whole flood in: the bodies are read and parsed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter

import httpx

from tests.support.gateway_server import running_server

FLOOD, ROUNDS, BODY_CHARS = 200, 2, 1_000_000
SETTLE_S = 30.0          # the trim loop looks every 5 s by default


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS"))


async def _flood(url: str, key: str, n: int, chars: int) -> Counter:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * (chars // 5)}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n),
                                 headers={"Authorization": f"Bearer {key}"}) as c:
        rs = await asyncio.gather(*[c.post("/v1/chat/completions", json=body) for _ in range(n)],
                                  return_exceptions=True)
    return Counter(getattr(r, "status_code", type(r).__name__) for r in rs)


def test_resident_size_returns_after_a_flood_of_large_bodies(tmp_path):
    with running_server(tmp_path, "embedded") as srv:
        _, key = srv.tenant(quota={"max_concurrent_requests": FLOOD, "requests_per_minute": 10 * FLOOD})
        pid = srv.proc.pid
        assert asyncio.run(_flood(srv.url, key, 4, 1000)) == Counter({200: 4})
        start = _rss_mb(pid)
        peak = start
        for _ in range(ROUNDS):
            got = asyncio.run(_flood(srv.url, key, FLOOD, BODY_CHARS))
            assert set(got) <= {400, 503} and sum(got.values()) == FLOOD, got   # too long, or tokenizer busy
            peak = max(peak, _rss_mb(pid))
        ended = time.monotonic()
        deadline = ended + SETTLE_S
        while (now := _rss_mb(pid)) > start + 100 and time.monotonic() < deadline:
            time.sleep(1)
        figure = f"RSS {start} MB at the start, {peak} after the flood, {now} {time.monotonic() - ended:.0f} s later"
        print(figure)
        assert now <= start + 100, figure
        assert asyncio.run(_flood(srv.url, key, 2, 1000)) == Counter({200: 2})


def test_the_trim_loop_trims_after_the_flood_not_only_during_it(monkeypatch):
    """The policy alone, on a scripted process: a resident size that rose during a flood and
    stays high once it is over is trimmed at the next look (not only while it grows); a live
    heap that a trim cannot shrink is looked at less often, up to 4 x the interval."""
    from lockgate.gateway import memory

    # per look: (resident MB, what a trim would bring it down to)
    script = [(400, 400), (700, 700), (900, 900), (900, 420), (420, 420),
              (800, 800), (800, 800), (800, 800), (800, 800)]
    proc = {"rss": 400, "live": 400}
    trims: list[tuple[int, int]] = []
    waits: list[float] = []

    async def sleep(s: float) -> None:
        if len(waits) == len(script):
            raise asyncio.CancelledError
        proc["rss"], proc["live"] = script[len(waits)]
        waits.append(s)

    def trim() -> bool:
        trims.append((proc["rss"], proc["live"]))
        proc["rss"] = proc["live"]
        return True

    monkeypatch.setattr(memory, "trim", trim)
    monkeypatch.setattr(memory.asyncio, "sleep", sleep)
    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(memory.trim_loop(5.0, 64 << 20, lambda: proc["rss"] << 20))
    assert trims[:3] == [(700, 700), (900, 900), (900, 420)]      # the last: the flood is over
    assert waits == [5.0, 5.0, 10.0, 20.0, 5.0, 5.0, 10.0, 20.0, 20.0]
