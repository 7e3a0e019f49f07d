"""`lockgate bench serve`: throughput against latency, per service tier, from any
OpenAI-compatible server (Lockgate, or another one to compare with).

Each rate step sends Poisson arrivals (exponential gaps from a generator seeded by the seed
and the rate) for `duration_s`, open loop: a request is sent when it is due, whatever the
earlier ones are doing, up to `max_in_flight` at once (past that a due request waits, and its
send lag says so). The step ends when every request has ended, or at `duration_s + drain_s`,
when those still out are cancelled and count as failures ("unfinished").

Every request streams (`stream_options.include_usage`), with `max_tokens` and no
`ignore_eos`. Measured from the send: TTFT to the first chunk with content (a stream with
none: to its end), ITL the gaps between content chunks, e2e to the end, and
TPOT = (e2e - TTFT) / (output tokens - 1), output tokens from the usage chunk or else the
content chunks counted. A 429 is a refusal, counted apart from the failures. Goodput is the
completed requests per second that met both SLOs (TTFT, and TPOT where there is one).
Throughputs divide by the step's elapsed time: from its start to its last request's end.
"""

from __future__ import annotations

import asyncio
import csv
import importlib.util
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lockgate.loadtests.harness.load import run_loop
from lockgate.loadtests.stats import percentile

NO_TIER = "none"          # the tier mix's name for requests that send no `service_tier`
ALL = "all"               # the summary over every tier
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
         "quietly", "judge", "boxing", "matches", "under", "pale", "lamps", "near", "old", "river", "banks")


class BenchServeError(Exception):
    """The benchmark cannot run: the server or the arguments."""


@dataclass(slots=True, frozen=True)
class ServeConfig:
    url: str                          # the server's base URL (a trailing /v1 is accepted)
    rates: tuple[float, ...]          # requests per second, one step each
    tier_mix: tuple[tuple[str, float], ...] = (("default", 1.0),)   # (tier, weight)
    api_key: str | None = None
    model: str | None = None          # None: the first of GET /v1/models
    duration_s: float = 10.0          # arrivals fall in this window, per rate
    drain_s: float = 30.0             # then at most this long for the requests still out
    prompt_words: int = 64
    max_tokens: int = 64
    slo_ttft_ms: float = 500.0
    slo_tpot_ms: float = 50.0
    seed: int = 0
    max_requests: int | None = None   # cap on arrivals per rate
    timeout_s: float = 60.0           # per request
    endpoint: Literal["chat", "completions"] = "chat"
    max_in_flight: int = 512

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise BenchServeError("rates: give one or more positive rates")
        if not self.tier_mix or any(not w > 0 for _, w in self.tier_mix):
            raise BenchServeError("tier mix: give one or more tiers with positive weights")
        if not (self.duration_s > 0 and self.drain_s >= 0 and self.timeout_s > 0):
            raise BenchServeError("duration and timeout must be positive, drain not negative")
        if self.prompt_words < 1 or self.max_tokens < 1 or self.max_in_flight < 1:
            raise BenchServeError("prompt words, max tokens and max in flight must be at least 1")
        if self.max_requests is not None and self.max_requests < 1:
            raise BenchServeError("max requests must be at least 1")

    @property
    def tiers(self) -> list[str]:
        return [t for t, _ in self.tier_mix]


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise BenchServeError(f"rates: expected numbers separated by commas, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise BenchServeError("rates: give one or more positive rates")
    return rates


def parse_tier_mix(text: str) -> tuple[tuple[str, float], ...]:
    """`default=0.7,flex=0.3` -> weights per tier; a bare name weighs 1; `none` sends no tier."""
    mix: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, _, weight = part.partition("=")
        try:
            mix[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise BenchServeError(f"tier mix: {part!r} is not NAME=WEIGHT") from None
    if not mix or any(not n for n in mix) or any(not w > 0 for w in mix.values()):
        raise BenchServeError(f"tier mix: expected NAME=WEIGHT,... with positive weights, got {text!r}")
    return tuple(mix.items())


# -- one request ------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Arrival:
    index: int
    at_s: float                       # due this long after the step's start
    tier: str
    prompt: str


@dataclass(slots=True)
class RequestResult:
    index: int
    tier: str
    at_s: float
    lag_s: float = math.nan           # sent this long after it was due
    status: int | None = None         # the HTTP status; None when none came
    error: str | None = None          # None: it succeeded
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)

    @property
    def outcome(self) -> Literal["ok", "refused", "failed"]:
        if self.error is None:
            return "ok"
        return "refused" if self.status == 429 else "failed"

    @property
    def failure_key(self) -> str:
        """The failure's bucket: its HTTP status, or the kind of error when there was none."""
        if self.status is not None and self.status != 200:
            return str(self.status)
        return (self.error or "").split(":", 1)[0]

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2 or math.isnan(self.ttft_s):
            return math.nan
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets_slo(self, slo_ttft_s: float, slo_tpot_s: float) -> bool:
        """Completed within both targets (one with a single output token has no TPOT to miss)."""
        tpot = self.tpot_s
        return self.outcome == "ok" and self.ttft_s <= slo_ttft_s and (math.isnan(tpot) or tpot <= slo_tpot_s)


def arrivals(cfg: ServeConfig, rate: float) -> list[Arrival]:
    """The step's schedule: exponential gaps at `rate`, tiers drawn by weight, prompts of
    `prompt_words` words (each different), from a generator seeded by the seed and the rate."""
    rng = random.Random(f"{cfg.seed}:{rate}")
    weights = [w for _, w in cfg.tier_mix]
    out: list[Arrival] = []
    t = rng.expovariate(rate)
    while t < cfg.duration_s and (cfg.max_requests is None or len(out) < cfg.max_requests):
        words = " ".join(rng.choice(WORDS) for _ in range(cfg.prompt_words - 1))
        out.append(Arrival(len(out), t, rng.choices(cfg.tiers, weights)[0], f"{len(out)} {words}"))
        t += rng.expovariate(rate)
    return out


def request_body(cfg: ServeConfig, model: str, a: Arrival) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": cfg.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": a.prompt}]
    else:
        body["prompt"] = a.prompt
    if a.tier != NO_TIER:
        body["service_tier"] = a.tier
    return body


def chunk_text(event: dict[str, Any]) -> str:
    """The content a stream chunk carries (chat's delta or a completion's text)."""
    text = ""
    for choice in event.get("choices") or ():
        delta = choice.get("delta")
        text += (delta.get("content") or "") if delta is not None else (choice.get("text") or "")
    return text


async def send(session: Any, cfg: ServeConfig, model: str, a: Arrival, res: RequestResult) -> None:
    """One streamed request, its timings written into `res` as they come."""
    url = base_url(cfg.url) + ("/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions")
    clock = time.perf_counter
    t0 = clock()
    async with session.post(url, json=request_body(cfg, model, a)) as resp:
        res.status = resp.status
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        last, num_chunks, usage_tokens = None, 0, None
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                res.error = f"stream error: {json.dumps(event['error'])[:200]}"
                return
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            if chunk_text(event):
                now = clock()
                if last is None:
                    res.ttft_s = now - t0
                else:
                    res.itl_s.append(now - last)
                last, num_chunks = now, num_chunks + 1
    res.e2e_s = clock() - t0
    if math.isnan(res.ttft_s):
        res.ttft_s = res.e2e_s
    res.output_tokens = usage_tokens if usage_tokens is not None else num_chunks


async def guarded_send(session: Any, cfg: ServeConfig, model: str, a: Arrival, res: RequestResult) -> None:
    try:
        await send(session, cfg, model, a, res)
    except TimeoutError:
        res.error = "timeout: no end within --timeout"
    except asyncio.CancelledError:
        res.error = "unfinished: still out when the step's drain ended"
        raise
    except Exception as exc:  # noqa: BLE001 - counted as a failure, the step goes on
        res.error = f"{type(exc).__name__}: {exc}"[:200]


# -- one rate step ----------------------------------------------------------------------------------
async def run_step(session: Any, cfg: ServeConfig, model: str, rate: float,
                   progress=None) -> tuple[list[RequestResult], float]:
    """Send the step's arrivals open loop; (results, elapsed seconds: from the step's start to
    the later of the window's end and the last request's end)."""
    plan = arrivals(cfg, rate)
    results = [RequestResult(a.index, a.tier, a.at_s) for a in plan]
    slots = asyncio.Semaphore(cfg.max_in_flight)
    num_ended = 0
    clock = time.perf_counter
    t0 = clock() + 0.05

    async def one(a: Arrival, res: RequestResult) -> None:
        nonlocal num_ended
        try:
            async with slots:
                res.lag_s = clock() - (t0 + a.at_s)
                await guarded_send(session, cfg, model, a, res)
        finally:
            num_ended += 1

    tasks: list[asyncio.Task] = []
    for a, res in zip(plan, results, strict=True):
        delay = t0 + a.at_s - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(a, res)))
        if progress is not None:
            progress(len(tasks), num_ended, len(plan))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + cfg.duration_s + cfg.drain_s - clock()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    elapsed = max(clock() - t0, cfg.duration_s)
    for res in results:               # cancelled while waiting for a slot
        if res.error is None and math.isnan(res.e2e_s):
            res.error = "unfinished: still out when the step's drain ended"
    return results, elapsed


def dist_ms(values_s: list[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 in milliseconds (None when there are no values)."""
    vals = [v * 1e3 for v in values_s if not math.isnan(v)]
    if not vals:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": sum(vals) / len(vals), **{f"p{p}": percentile(vals, p) for p in (50, 90, 99)}}


def summarize(results: list[RequestResult], elapsed_s: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict:
    """One tier's (or all tiers') figures for a step."""
    ok = [r for r in results if r.outcome == "ok"]
    good = sum(r.meets_slo(slo_ttft_ms / 1e3, slo_tpot_ms / 1e3) for r in ok)
    failures = Counter(r.failure_key for r in results if r.outcome == "failed")
    return {
        "requests": len(results),
        "completed": len(ok),
        "refused": sum(r.outcome == "refused" for r in results),
        "failed": sum(failures.values()),
        "failures": dict(failures),
        "good": good,
        "request_throughput": len(ok) / elapsed_s,
        "output_throughput": sum(r.output_tokens for r in ok) / elapsed_s,
        "goodput": good / elapsed_s,
        "output_tokens": sum(r.output_tokens for r in ok),
        "ttft_ms": dist_ms([r.ttft_s for r in ok]),
        "tpot_ms": dist_ms([r.tpot_s for r in ok]),
        "itl_ms": dist_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": dist_ms([r.e2e_s for r in ok]),
    }


def step_summary(cfg: ServeConfig, rate: float, results: list[RequestResult], elapsed_s: float) -> dict:
    by_tier = {t: summarize([r for r in results if r.tier == t], elapsed_s, cfg.slo_ttft_ms, cfg.slo_tpot_ms)
               for t in cfg.tiers}
    lag_p99 = percentile([r.lag_s for r in results], 99)
    return {"rate": rate, "arrivals": len(results), "arrival_rate": len(results) / cfg.duration_s,
            "elapsed_s": elapsed_s,
            "send_lag_p99_ms": None if math.isnan(lag_p99) else lag_p99 * 1e3,
            "failure_examples": sorted({r.error or "" for r in results if r.outcome == "failed"})[:5],
            ALL: summarize(results, elapsed_s, cfg.slo_ttft_ms, cfg.slo_tpot_ms), "tiers": by_tier}


# -- printing and files -----------------------------------------------------------------------------
def _ms(d: dict, *keys: str) -> str:
    return "/".join("-" if d[k] is None else f"{d[k]:.0f}" for k in keys)


def table(step: dict) -> list[str]:
    head = (f"{'tier':<10}{'done':>6}{'429':>5}{'fail':>5}{'req/s':>7}{'tok/s':>8}{'good/s':>7}"
            f"{'TTFT p50/90/99':>17}{'TPOT p50/90/99':>17}{'ITL p50/99':>12}{'E2E p50/99':>13}")
    lines = [head]
    rows = [*step["tiers"].items(), (ALL, step[ALL])] if len(step["tiers"]) > 1 else [(ALL, step[ALL])]
    for name, s in rows:
        lines.append(f"{name:<10}{s['completed']:>6}{s['refused']:>5}{s['failed']:>5}"
                     f"{s['request_throughput']:>7.2f}{s['output_throughput']:>8.1f}{s['goodput']:>7.2f}"
                     f"{_ms(s['ttft_ms'], 'p50', 'p90', 'p99'):>17}{_ms(s['tpot_ms'], 'p50', 'p90', 'p99'):>17}"
                     f"{_ms(s['itl_ms'], 'p50', 'p99'):>12}{_ms(s['e2e_ms'], 'p50', 'p99'):>13}")
    if step[ALL]["failures"]:
        lines.append(f"failures: {step[ALL]['failures']}; e.g. {step['failure_examples'][0]}")
    return lines


CSV_FIELDS = ("rate", "index", "tier", "at_s", "lag_ms", "status", "outcome", "error", "ttft_ms", "tpot_ms",
              "e2e_ms", "output_tokens", "itl_p50_ms", "itl_max_ms")


def csv_row(rate: float, r: RequestResult) -> dict[str, Any]:
    def ms(x: float) -> str:
        return "" if math.isnan(x) else f"{x * 1e3:.3f}"

    return {"rate": rate, "index": r.index, "tier": r.tier, "at_s": f"{r.at_s:.4f}", "lag_ms": ms(r.lag_s),
            "status": r.status or "", "outcome": r.outcome, "error": r.error or "", "ttft_ms": ms(r.ttft_s),
            "tpot_ms": ms(r.tpot_s), "e2e_ms": ms(r.e2e_s), "output_tokens": r.output_tokens,
            "itl_p50_ms": ms(percentile(r.itl_s, 50)), "itl_max_ms": ms(max(r.itl_s, default=math.nan))}


def _plain(v: float, _pos: object = None) -> str:
    return f"{v:g}"


def _mantissa(v: float) -> int:
    return round(v / 10 ** math.floor(math.log10(v))) if v > 0 else 0


def plot(report: dict, out_dir: Path) -> list[Path]:
    """latency_vs_throughput.png (TTFT and TPOT p50 solid, p99 dashed, per tier, against the
    server's output tokens/s) and goodput_vs_rate.png (goodput per tier against the offered rate)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    steps, tiers = report["steps"], [*report["tiers"], ALL]
    x = [s[ALL]["output_throughput"] for s in steps]
    fig = Figure(figsize=(12, 5), layout="constrained")
    for ax, metric, slo in zip(fig.subplots(1, 2), ("ttft_ms", "tpot_ms"), ("slo_ttft_ms", "slo_tpot_ms"),
                               strict=True):
        for i, tier in enumerate(tiers):
            rows = [s[ALL] if tier == ALL else s["tiers"][tier] for s in steps]
            for p, style, marker in (("p50", "-", "o"), ("p99", "--", "^")):
                y = [math.nan if r[metric][p] is None else r[metric][p] for r in rows]
                ax.plot(x, y, style, marker=marker, color=f"C{i}", label=f"{tier} {p}")
        ax.axhline(report[slo], color="grey", linestyle=":", label=f"SLO {report[slo]:g} ms")
        ax.set_yscale("log")      # the knee and the SLO on one scale, however far apart
        ax.yaxis.set_major_formatter(FuncFormatter(_plain))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: _plain(v) if _mantissa(v) in (2, 5) else ""))
        for xi, s in zip(x, steps, strict=True):
            ax.annotate(f"{s['rate']:g}/s", (xi, 0), xycoords=("data", "axes fraction"), fontsize=7,
                        ha="center", va="bottom", color="grey")
        ax.set(xlabel="output tokens/s (all tiers)", ylabel=f"{metric[:4].upper()} (ms, log scale)",
               title=f"{metric[:4].upper()} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{report['model']} at {report['url']} ({report['endpoint']}, max_tokens {report['max_tokens']})")
    curve = out_dir / "latency_vs_throughput.png"
    fig.savefig(curve, dpi=100)

    fig = Figure(figsize=(6, 4.5), layout="constrained")
    ax = fig.subplots()
    rates = [s["rate"] for s in steps]
    ax.plot(rates, [s["arrival_rate"] for s in steps], ":", marker=".", color="grey", label="arrived")
    for i, tier in enumerate(tiers):
        ax.plot(rates, [(s[ALL] if tier == ALL else s["tiers"][tier])["goodput"] for s in steps],
                marker="o", color=f"C{i}", label=tier)
    ax.set(xlabel="offered rate (req/s)", ylabel="goodput (req/s)",
           title=f"goodput: TTFT <= {report['slo_ttft_ms']:g} ms, TPOT <= {report['slo_tpot_ms']:g} ms")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    goodput = out_dir / "goodput_vs_rate.png"
    fig.savefig(goodput, dpi=100)
    return [curve, goodput]


def write_outputs(report: dict, rows: list[dict], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    with (out_dir / "requests.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)
    return [out_dir / "results.json", out_dir / "requests.csv", *plot(report, out_dir)]


# -- the run ----------------------------------------------------------------------------------------
def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def first_model(session: Any, url: str) -> str:
    async with session.get(url + "/v1/models") as resp:
        if resp.status != 200:
            raise BenchServeError(f"GET /v1/models: HTTP {resp.status}: {(await resp.text())[:200]}")
        models = (await resp.json()).get("data") or []
    if not models:
        raise BenchServeError("GET /v1/models: the server lists no model; give --model")
    return models[0]["id"]


def live_progress(rate: float):
    """On a terminal, one line rewritten as the step sends; elsewhere nothing."""
    if not sys.stdout.isatty():
        return None

    def progress(sent: int, ended: int, total: int) -> None:
        sys.stdout.write(f"\r  rate {rate:g} req/s: sent {sent}/{total}, ended {ended} ")
        sys.stdout.flush()

    return progress


async def _run(cfg: ServeConfig, echo) -> tuple[dict, list[dict]]:
    import aiohttp

    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connector = aiohttp.TCPConnector(limit=cfg.max_in_flight)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
        try:
            model = cfg.model or await first_model(session, base_url(cfg.url))
        except aiohttp.ClientError as exc:
            raise BenchServeError(f"{cfg.url}: {type(exc).__name__}: {exc}") from None
        report: dict[str, Any] = {
            "url": cfg.url, "model": model, "endpoint": cfg.endpoint, "tiers": cfg.tiers,
            "tier_mix": dict(cfg.tier_mix), "duration_s": cfg.duration_s, "drain_s": cfg.drain_s,
            "prompt_words": cfg.prompt_words, "max_tokens": cfg.max_tokens, "slo_ttft_ms": cfg.slo_ttft_ms,
            "slo_tpot_ms": cfg.slo_tpot_ms, "seed": cfg.seed, "steps": []}
        rows: list[dict] = []
        for i, rate in enumerate(cfg.rates):
            echo(f"[{i + 1}/{len(cfg.rates)}] rate {rate:g} req/s: Poisson arrivals over {cfg.duration_s:g} s "
                 f"(drain up to {cfg.drain_s:g} s), {model}, tiers {','.join(cfg.tiers)}")
            progress = live_progress(rate)
            results, elapsed = await run_step(session, cfg, model, rate, progress)
            step = step_summary(cfg, rate, results, elapsed)
            report["steps"].append(step)
            rows += [csv_row(rate, r) for r in results]
            if progress is not None:
                echo("")
            lag = step["send_lag_p99_ms"]
            echo(f"rate {rate:g} req/s: {len(results)} sent, elapsed {elapsed:.1f} s, send lag p99 "
                 f"{'-' if lag is None else f'{lag:.1f}'} ms; latencies in ms")
            for line in table(step):
                echo("  " + line)
    return report, rows


def bench_serve(cfg: ServeConfig, out_dir: Path | None = None, echo=print) -> dict:
    """Run every rate step; print a table per step; write results.json, requests.csv and the
    plots under `out_dir` (when given). Returns the report."""
    if out_dir is not None and importlib.util.find_spec("matplotlib") is None:   # before the run, not after
        raise BenchServeError("--out draws plots with matplotlib: pip install -e '.[bench]'")
    report, rows = run_loop(_run(cfg, echo))
    if out_dir is not None:
        for path in write_outputs(report, rows, out_dir):
            echo(f"wrote {path}")
    return report
