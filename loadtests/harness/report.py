"""The gateway bench's figures: one step's summary (rates, latency percentiles, lag, client
CPU), how the load generator fared, and the printed table and verdicts."""

from __future__ import annotations

import math
from typing import Any

from lockgate.loadtests.stats import percentile

TARGET_P50_MS = 2.0
TARGET_P99_MS = 10.0
HELD_P99_MS = 25.0


def summarize(res: dict[str, Any], rate: float, duration: float) -> dict[str, Any]:
    lat = [x for x in res["lat"] if not math.isnan(x)]
    n = len(res["lat"])
    ok = len(lat)
    finite_done = [d for d in res["done"] if not math.isnan(d)]
    last_done = max(finite_done, default=duration)
    sends = [x for x in res["sent"] if not math.isnan(x)]
    span_sent = max(duration, (max(sends) + 1 / rate) if sends else duration)
    lag = res["lag"]
    return {
        "target_rps": rate,
        "requests": n,
        "ok": ok,
        "errors": n - ok,
        "error_kinds": res["errors"],
        "error_examples": res["examples"][:3],
        "sent_rps": n / span_sent,
        "achieved_rps": ok / max(duration, last_done),
        "p50_ms": percentile(lat, 50, method="nearest") * 1000,
        "p90_ms": percentile(lat, 90, method="nearest") * 1000,
        "p99_ms": percentile(lat, 99, method="nearest") * 1000,
        "max_ms": (max(lat) * 1000) if lat else math.nan,
        "lag_p50_ms": percentile(lag, 50, method="nearest") * 1000,
        "lag_p99_ms": percentile(lag, 99, method="nearest") * 1000,
        "client_cpu": res["cpu_s"] / max(duration, last_done),
    }


def generator_state(row: dict[str, Any], clients: int) -> str:
    """How the load generator fared in a step:
    - "kept up": it sent at the target rate, on schedule (lag p99 <= 5 ms);
    - "limited": it fell behind with its own CPU (nearly) a full core per client process: the
      generator, not the gateway, held the rate back;
    - "starved": it fell behind with CPU to spare for itself but the machine's cores all busy:
      the gateway, its services, the generator and other work together wanted more CPU than
      the machine has (the generator is then one of the things competing, not the cause);
    - "behind": it fell behind with neither (a stall elsewhere)."""
    behind = row["sent_rps"] < 0.95 * row["target_rps"] or row["lag_p99_ms"] > 5.0
    if not behind:
        return "kept up"
    if row["client_cpu"] > 0.85 * clients:
        return "limited"
    if row.get("machine_cpu", 0.0) > 0.9:
        return "starved"
    return "behind"


def nearest(rates: list[float], ref: float) -> float:
    return min(rates, key=lambda r: (abs(r - ref), r))


def jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def print_report(results: list[dict], direct: dict[float, dict], floor_res: dict | None, ref_rate: float,
            clients: int, usage_rows: int | None, ok_total: int, redis_keys: int | None,
            notes: list[str], echo) -> dict[str, Any]:
    """The table of rate steps, then the verdicts: added latency at the reference rate, the
    highest rate held, the load generator's state; the report as a dict."""
    _print_table(results, echo)
    report: dict[str, Any] = {"rates": results, "direct": list(direct.values()), "floor": floor_res,
                              "clients": clients, "notes": notes}
    echo("")
    if floor_res is not None:
        echo(f"HTTP floor (bare uvicorn, same client) at {floor_res['target_rps']:g} req/s: "
             f"p50 {floor_res['p50_ms']:.2f} ms, p99 {floor_res['p99_ms']:.2f} ms, "
             f"errors {floor_res['errors']}, server CPU {floor_res['server_cpu'] * 100:.0f}%, "
             f"others {floor_res['others_cpu'] * 100:.0f}%")
    report.update(_added_latency(results, floor_res, ref_rate, echo))
    held = [r["target_rps"] for r in results
            if r["errors"] == 0 and r["achieved_rps"] >= 0.95 * r["target_rps"]
            and r["p99_ms"] < HELD_P99_MS]
    report["max_rate_p99_under_25ms"] = max(held) if held else None
    tried = ", ".join(f"{r['target_rps']:g}" for r in results)
    at_top = held and max(held) == results[-1]["target_rps"]
    echo(f"highest rate held with p99 < {HELD_P99_MS:g} ms: "
         f"{f'{max(held):g} req/s' if held else 'none'} (of {tried}"
         f"{'; the highest tried, so the gateway may hold more' if at_top else ''})")
    report["generator_limited_rates"] = _generator_verdict(results, floor_res, echo)
    report["usage_rows"] = usage_rows
    report["ok_responses"] = ok_total
    report["redis_keys"] = redis_keys
    if usage_rows is not None:
        echo(f"usage rows committed: {usage_rows} for {ok_total} successful responses; "
             f"limiter keys in Redis: {redis_keys}")
    for n in notes:
        echo(f"note: {n}")
    return report


def _print_table(results: list[dict], echo) -> None:
    """A row per rate step: rates, gateway and direct latency, what the gateway added, the
    generator's lag and the CPU of each party; then warnings of other load and the errors."""
    echo("")
    echo("gateway (HTTP, PostgreSQL, Redis, instant engine) vs the same engine called directly; ms")
    echo(f"{'target':>7}{'sent/s':>8}{'done/s':>8}{'errors':>7} |{'gw p50':>8}{'gw p99':>9} |"
         f"{'dir p50':>8}{'dir p99':>8} |{'add p50':>8}{'add p99':>9} |{'lag p99':>8}"
         f"{'client':>7}{'server':>7}{'pg+rds':>7}{'others':>7}")
    for r in results:
        echo(f"{r['target_rps']:>7g}{r['sent_rps']:>8.1f}{r['achieved_rps']:>8.1f}{r['errors']:>7} |"
             f"{r['p50_ms']:>8.2f}{r['p99_ms']:>9.2f} |{r['direct_p50_ms']:>8.3f}"
             f"{r['direct_p99_ms']:>8.3f} |{r['added_p50_ms']:>8.2f}{r['added_p99_ms']:>9.2f} |"
             f"{r['lag_p99_ms']:>8.2f}{r['client_cpu'] * 100:>6.0f}%{r['server_cpu'] * 100:>6.0f}%"
             f"{r['services_cpu'] * 100:>6.0f}%{r['others_cpu'] * 100:>6.0f}%")
    echo("(CPU, % of one core: client = the load generator, server = the gateway process, "
         "pg+rds = all PostgreSQL and Redis processes, others = the rest of the machine)")
    noisy = [r for r in results if r["others_cpu"] > 0.25]
    if noisy:
        echo("warning: other work on this machine took "
             + ", ".join(f"{r['others_cpu'] * 100:.0f}% of a core at {r['target_rps']:g} req/s"
                         for r in noisy)
             + "; those figures are inflated by it (--repeats N keeps the best of N attempts)")
    for r in results:
        if r["errors"]:
            echo(f"  errors at {r['target_rps']:g} req/s: {r['error_kinds']} e.g. {r['error_examples'][:1]}")


def _added_latency(results: list[dict], floor_res: dict | None, ref_rate: float, echo) -> dict[str, Any]:
    """The added latency at the step nearest `ref_rate` against its targets, and how far it is
    above the bare-HTTP floor (when that ran at the same rate); {} when no step ran."""
    ref = next((r for r in results if r["target_rps"] == nearest([x["target_rps"] for x in results],
                                                                      ref_rate)), None) if results else None
    if ref is None:
        return {}
    ok50 = ref["added_p50_ms"] <= TARGET_P50_MS
    ok99 = ref["added_p99_ms"] <= TARGET_P99_MS
    out: dict[str, Any] = {"reference": {
        "rate": ref["target_rps"], "added_p50_ms": ref["added_p50_ms"],
        "added_p99_ms": ref["added_p99_ms"], "p50_target_ms": TARGET_P50_MS,
        "p99_target_ms": TARGET_P99_MS, "p50_met": ok50, "p99_met": ok99,
    }}
    if ref["target_rps"] != ref_rate:
        echo(f"({ref_rate:g} req/s was not run; the nearest rate, {ref['target_rps']:g}, stands in)")
    echo(f"added latency at {ref['target_rps']:g} req/s, p50: {ref['added_p50_ms']:6.2f} ms "
         f"(target <= {TARGET_P50_MS:g}: {'met' if ok50 else 'MISSED'})")
    echo(f"added latency at {ref['target_rps']:g} req/s, p99: {ref['added_p99_ms']:6.2f} ms "
         f"(target <= {TARGET_P99_MS:g}: {'met' if ok99 else 'MISSED'})")
    if floor_res is not None and floor_res["target_rps"] == ref["target_rps"]:
        out["over_floor_p50_ms"] = ref["p50_ms"] - floor_res["p50_ms"]
        out["over_floor_p99_ms"] = ref["p99_ms"] - floor_res["p99_ms"]
        echo(f"  of which above the bare-HTTP floor: p50 {out['over_floor_p50_ms']:.2f} ms, "
             f"p99 {out['over_floor_p99_ms']:.2f} ms")
    return out


def _generator_verdict(results: list[dict], floor_res: dict | None, echo) -> list[float]:
    """How the load generator fared at each rate, and whether it was the bottleneck; the
    rates where it was."""
    limited = [r["target_rps"] for r in results if r["generator_limited"]]
    if results:
        echo("load generator: " + "; ".join(
            f"{r['target_rps']:g} req/s {r['generator']} (sent {r['sent_rps']:.0f}/s, lag p99 "
            f"{r['lag_p99_ms']:.1f} ms, {r['client_cpu'] * 100:.0f}% CPU, machine "
            f"{r['machine_cpu'] * 100:.0f}% busy)" for r in results))
        verdict = ("it was the bottleneck at " + ", ".join(f"{x:g}" for x in limited) + " req/s"
                   if limited else "it was not the bottleneck at any rate")
        if floor_res is not None:
            verdict += (f"; against bare uvicorn it sent {floor_res['sent_rps']:.0f}/s at "
                        f"{floor_res['target_rps']:g} req/s with {floor_res['client_cpu'] * 100:.0f}% "
                        f"CPU, lag p99 {floor_res['lag_p99_ms']:.1f} ms")
        echo(f"  verdict: {verdict}")
    return limited
