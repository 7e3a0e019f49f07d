"""`lockgate bench flood`: what one tenant's flood costs another tenant, side by side in one
run. The victim's `default` streaming chats (max_tokens 2) are timed to their first token
(TTFT) three ways:

- alone: nobody else sends anything;
- beside a flood: one tenant keeps `flood_streams` `flex` streams open at once (each slot
  reopened as soon as it ends or is refused), the way a batch client that ignores its limits
  would;
- beside grammar bombs: `bombers` loops of chats whose regex constraint expands to millions
  of states (loadtests/harness/bombs.py, each made distinct so that no cache helps), each
  sending one every `bomb_interval_s` (0.1 s). A bomb used to cost the server seconds of
  compiling and masking, so a loop sent a few a second; refused from its text it now costs
  what any 400 does (2.3 ms a round trip here, 1.5 ms for a bad temperature), and a loop
  that sends the next at once is a request flood, the flood side's subject, not a grammar's.

One `lockgate serve` on its defaults but for its data (a PostgreSQL and a Redis of the bench's
own, the demo model), a fresh process for every side of every repeat, the sides' order
rotated; the flood and the bombs come from a client process of their own so that the probe's
client is not the one kept busy. Per side: the victim's TTFT p50/p99 (the best p99 of the
repeats, with its p50) and every status the victim got, and what the flooder got. Targets:
beside the flood, p99 within 1 s and no 503 for the victim; beside the bombs, p99 within 2 x
alone.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import secrets
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lockgate.loadtests.harness.bombs import BOMB_PATTERNS
from lockgate.loadtests.harness.own_redis import OwnRedis
from lockgate.loadtests.harness.pg import throwaway_postgres
from lockgate.loadtests.harness.replica import Replica, serve_env

__all__ = ["FloodConfig", "bench_flood"]

SIDES = ("alone", "flood", "bomb")
PREFIX = "flood:"


@dataclass
class FloodConfig:
    flood_streams: int = 1500
    flood_max_tokens: int = 256
    bombers: int = 4
    bomb_interval_s: float = 0.1  # each bomber's pace (0: as fast as answers come)
    probes: int = 40            # the victim's chats per side and repeat, one after another
    repeats: int = 2
    warmup_s: float = 5.0       # the flood or the bombs run this long before the first probe


@dataclass
class SideRun:
    ttft: list[float] = field(default_factory=list)
    victim: Counter[str] = field(default_factory=Counter)
    other: Counter[str] = field(default_factory=Counter)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- the other tenant's traffic (a client process of its own) ------------------------------------
async def _other_traffic(url: str, key: str, kind: str, cfg: FloodConfig, stop: Any, out: Any) -> None:
    import aiohttp

    counts: Counter[str] = Counter()
    headers = {"Authorization": f"Bearer {key}"}
    seq = iter(range(10**9))

    def body() -> dict:
        if kind == "flood":
            return {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story."}],
                    "max_tokens": cfg.flood_max_tokens, "ignore_eos": True, "stream": True,
                    "service_tier": "flex"}
        n = next(seq)
        pattern = BOMB_PATTERNS[n % len(BOMB_PATTERNS)] + f"q{{{n % 97 + 1}}}"   # distinct: no cache hit
        return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "guided_regex": pattern}

    async def slot(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/chat/completions", json=body(), headers=headers) as r:
                    counts[str(r.status)] += 1
                    async for _ in r.content.iter_any():
                        if stop.is_set():
                            break
                    if r.status == 429:
                        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    elif kind == "bomb":
                        await asyncio.sleep(cfg.bomb_interval_s)
            except (TimeoutError, aiohttp.ClientError) as exc:
                counts[type(exc).__name__] += 1
                await asyncio.sleep(0.5)

    slots = cfg.flood_streams if kind == "flood" else cfg.bombers
    conn = aiohttp.TCPConnector(limit=slots + 10)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [asyncio.create_task(slot(session)) for _ in range(slots)]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out.put(dict(counts))


def _other_main(url: str, key: str, kind: str, cfg: FloodConfig, stop: Any, out: Any) -> None:
    asyncio.run(_other_traffic(url, key, kind, cfg, stop, out))


# -- the victim's probes --------------------------------------------------------------------------
def _probe(client: httpx.Client, key: str) -> tuple[str, float | None]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2,
            "stream": True}
    t0 = time.perf_counter()
    try:
        with client.stream("POST", "/v1/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                r.read()
                return str(r.status_code), None
            ttft = None
            for line in r.iter_lines():
                if ttft is None and line.startswith("data: {"):
                    choices = json.loads(line[len("data: "):]).get("choices") or []
                    if any(c.get("delta", {}).get("content") for c in choices):
                        ttft = time.perf_counter() - t0
            return "200", ttft if ttft is not None else time.perf_counter() - t0
    except httpx.HTTPError as exc:
        return type(exc).__name__, None


def _side(kind: str, replica: Replica, keys: dict[str, str], cfg: FloodConfig) -> SideRun:
    run = SideRun()
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    proc = None
    if kind != "alone":
        proc = ctx.Process(target=_other_main, args=(replica.url, keys["other"], kind, cfg, stop, out))
        proc.start()
        time.sleep(cfg.warmup_s)
    try:
        with httpx.Client(base_url=replica.url, timeout=60) as client:
            for _ in range(cfg.probes):
                status, ttft = _probe(client, keys["victim"])
                run.victim[status] += 1
                if ttft is not None:
                    run.ttft.append(ttft)
                time.sleep(0.05)
    finally:
        if proc is not None:
            stop.set()
            try:
                run.other.update(out.get(timeout=60))
            except Exception:  # noqa: BLE001 - the client process died: its counts are lost
                run.other["lost"] += 1
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    return run


# -- the run ----------------------------------------------------------------------------------------
def _tenants(replica: Replica, admin_key: str) -> dict[str, str]:
    keys = {}
    with httpx.Client(base_url=replica.url + "/admin/v1", timeout=30,
                      headers={"Authorization": f"Bearer {admin_key}"}) as admin:
        for who in ("victim", "other"):
            r = admin.post("/tenants", json={"name": f"flood-{who}"})
            r.raise_for_status()
            k = admin.post(f"/tenants/{r.json()['id']}/keys", json={"name": who})
            k.raise_for_status()
            keys[who] = k.json()["key"]
    return keys


def run_flood(cfg: FloodConfig, work: Path, echo: Callable[[str], None]) -> dict[str, list[SideRun]]:
    from lockgate.engine.demo_model import write_demo_model

    model = work / "model"
    write_demo_model(model, family="llama", size="tiny", seed=0)
    runs: dict[str, list[SideRun]] = {s: [] for s in SIDES}
    admin_key = "lg-" + secrets.token_urlsafe(24)
    with throwaway_postgres() as pg:
        from lockgate.tenancy import db

        db.upgrade(pg.url, "head")
        redis = OwnRedis(work)
        try:
            env = serve_env(database_url=pg.url, redis_url=redis.url, redis_prefix=PREFIX,
                            pepper=secrets.token_hex(32), admin_key=admin_key, engine_kwargs={},
                            extra={"LOCKGATE_ADMIN_KEY": admin_key})
            replica = Replica(0, work / "replica", env, {"tiny": str(model)})
            keys: dict[str, str] | None = None
            for r in range(cfg.repeats):
                for kind in SIDES[r % 3:] + SIDES[:r % 3]:
                    replica.start()
                    if keys is None:
                        keys = _tenants(replica, admin_key)
                    try:
                        side = _side(kind, replica, keys, cfg)
                    finally:
                        replica.stop()
                    runs[kind].append(side)
                    echo(f"  {kind:<6} run {r + 1}: TTFT p50 {_pct(side.ttft, .5):.3f} s, "
                         f"p99 {_pct(side.ttft, .99):.3f} s; victim {dict(side.victim)}; other {dict(side.other)}")
        finally:
            redis.stop()
    return runs


def summarize(runs: dict[str, list[SideRun]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, sides in runs.items():
        best = min(sides, key=lambda s: _pct(s.ttft, .99))
        out[kind] = {"p50_s": _pct(best.ttft, .5), "p99_s": _pct(best.ttft, .99),
                     "victim": dict(sum((s.victim for s in sides), Counter())),
                     "other": dict(sum((s.other for s in sides), Counter()))}
    alone = out["alone"]["p99_s"]
    flood, bomb = out["flood"], out["bomb"]
    flood["target"] = "p99 <= 1 s, victim 0 x 503"
    flood["met"] = flood["p99_s"] <= 1.0 and not flood["victim"].get("503")
    bomb["target"] = "p99 <= 2 x alone"
    bomb["met"] = bomb["p99_s"] <= 2 * alone
    for kind in SIDES:
        out[kind]["vs_alone"] = out[kind]["p99_s"] / alone if alone else float("nan")
    return out


def bench_flood(cfg: FloodConfig, *, json_out: Path | None = None, echo: Callable[[str], None] = print) -> bool:
    echo(f"lockgate bench flood: {cfg.probes} probes a side, {cfg.repeats} repeats, flood "
         f"{cfg.flood_streams} streams, {cfg.bombers} bombers (one bomb each every {cfg.bomb_interval_s:g} s)")
    with tempfile.TemporaryDirectory(prefix="lockgate-flood-") as tmp:
        res = summarize(run_flood(cfg, Path(tmp), echo))
    echo("")
    echo(f"{'side':<7} {'TTFT p50':>9} {'TTFT p99':>9} {'p99/alone':>10}  victim statuses / other tenant's / target")
    for kind in SIDES:
        r = res[kind]
        target = f"  [{r['target']}: {'met' if r['met'] else 'NOT met'}]" if "target" in r else ""
        echo(f"{kind:<7} {r['p50_s']:>8.3f}s {r['p99_s']:>8.3f}s {r['vs_alone']:>9.2f}x  "
             f"{r['victim']} / {r['other']}{target}")
    if json_out is not None:
        json_out.write_text(json.dumps(res, indent=2))
    return bool(res["flood"]["met"] and res["bomb"]["met"])
