"""`lockgate loadtest`'s verdicts, from the per-request samples the locustfile wrote and the
gateway's usage report: per class, SLO attainment against stated targets; Jain's fairness
index across a class's tenants; the quota accounting error (tokens billed vs tokens the
clients received, target 0). Plain arithmetic on dicts, so it is tested on hand-made data.

A sample (one JSON line of `samples-*.jsonl`): t and start (Unix seconds), cls, tenant, name,
status, outcome (ok, expected, refused, failed; `created` marks a batch's creation, not a
request), user (the locust user, `online-3`), and where they apply ttft_ms, tpot_ms, itl_ms
(a list), prompt_tokens, completion_tokens, error.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from lockgate.loadtests.stats import percentile

OUTCOMES = ("ok", "expected", "refused", "failed")


@dataclass(slots=True, frozen=True)
class SloTargets:
    online_ttft_ms: float = 1000.0        # each online request's time to its first token
    online_tpot_ms: float = 250.0         # and its mean time per output token after that
    batch_turnaround_s: float = 300.0     # a batch from upload to downloaded output
    goal: float = 0.9                     # the attainment a class needs to pass
    fairness: float = 0.9                 # the Jain's index a class's tenants need

    def meets(self, s: dict[str, Any]) -> bool:
        """Whether one request met its class's target (a refusal or a failure never does,
        except a misbehaving user's expected refusal, which is its target)."""
        if s["cls"] == "bad":
            return s["outcome"] in ("expected", "ok")
        if s["outcome"] != "ok":
            return False
        if s["cls"] == "online":
            return (s.get("ttft_ms") is not None and s["ttft_ms"] <= self.online_ttft_ms
                    and (s.get("tpot_ms") is None or s["tpot_ms"] <= self.online_tpot_ms))
        if s["cls"] == "batch":
            return s["t"] - s["start"] <= self.batch_turnaround_s
        return True                       # offline: throughput only, every answer counts

    def describe(self, cls: str) -> str:
        return {
            "online": f"TTFT <= {self.online_ttft_ms:g} ms and TPOT <= {self.online_tpot_ms:g} ms",
            "offline": "answered (throughput only)",
            "batch": f"completed within {self.batch_turnaround_s:g} s",
            "bad": "refused with the expected status",
        }[cls]


def requests(samples: list[dict[str, Any]], cls: str | None = None) -> list[dict[str, Any]]:
    """The samples that are requests (not batch-creation marks), of `cls` if given."""
    return [s for s in samples if s["outcome"] in OUTCOMES and (cls is None or s["cls"] == cls)]


def attainment(samples: list[dict[str, Any]], targets: SloTargets) -> float | None:
    """The fraction of the requests that met their target; None when there are none."""
    if not samples:
        return None
    return sum(targets.meets(s) for s in samples) / len(samples)


def jain_index(values: list[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 when all are equal, 1/n when one
    value has it all; None for no values or all zero."""
    square_sum = sum(x * x for x in values)
    if not values or square_sum == 0:
        return None
    return sum(values) ** 2 / (len(values) * square_sum)


def fairness(tenants: list[dict[str, Any]], output_tokens: dict[str, int], duration_s: float,
             ) -> dict[str, dict[str, Any]]:
    """Per class with two tenants or more that had users: Jain's index over the tenants'
    output tokens per second divided by their weights. `users_proportional`: whether the
    tenants' users were exactly proportional to their weights (if not, a tenant's demand was
    not, and the index reflects that too, not only the gateway)."""
    by_class: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for t in tenants:
        if t["users"] > 0:
            by_class[t["cls"]].append(t)
    out = {}
    for cls, mine in by_class.items():
        if len(mine) < 2 or cls == "bad":
            continue
        normalised = {t["name"]: output_tokens.get(t["name"], 0) / duration_s / t["weight"] for t in mine}
        users_per_weight = {t["users"] / t["weight"] for t in mine}
        out[cls] = {"jain": jain_index(list(normalised.values())),
                    "tokens_per_s_per_weight": normalised,
                    "users_proportional": len(users_per_weight) == 1}
    return out


def received_tokens(samples: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per tenant, the prompt and completion tokens the clients were told of (the `usage` of
    each answer, stream or batch output)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"prompt_tokens": 0, "completion_tokens": 0})
    for s in requests(samples):
        for k in ("prompt_tokens", "completion_tokens"):
            out[s["tenant"]][k] += s.get(k) or 0
    return dict(out)


def accounting(reported: dict[str, dict[str, int]], received: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Per tenant |billed - received| prompt and completion tokens, and their total (target 0).
    Tenants in either map count (a tenant billed for nothing received is an error too)."""
    tenants = {}
    for name in sorted(set(reported) | set(received)):
        billed = reported.get(name, {})
        got = received.get(name, {})
        diff = {k: (billed.get(k) or 0) - (got.get(k) or 0) for k in ("prompt_tokens", "completion_tokens")}
        tenants[name] = {"billed": {k: billed.get(k) or 0 for k in diff},
                         "received": {k: got.get(k) or 0 for k in diff},
                         "error_tokens": sum(abs(d) for d in diff.values())}
    return {"error_tokens": sum(t["error_tokens"] for t in tenants.values()), "tenants": tenants}


def _pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": percentile(values, 50, method="nearest"), "p99": percentile(values, 99, method="nearest")}


def class_summary(samples: list[dict[str, Any]], cls: str, users: int, duration_s: float,
                  targets: SloTargets) -> dict[str, Any]:
    mine = requests(samples, cls)
    counts = Counter(s["outcome"] for s in mine)
    output_tokens = sum(s.get("completion_tokens") or 0 for s in mine)
    share = attainment(mine, targets)
    return {
        "users": users,
        "requests": len(mine),
        **{o: counts.get(o, 0) for o in OUTCOMES},
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration_s,
        "ttft_ms": _pct([s["ttft_ms"] for s in mine if s.get("ttft_ms") is not None]),
        "itl_ms": _pct([g for s in mine for g in s.get("itl_ms") or ()]),
        "latency_ms": _pct([(s["t"] - s["start"]) * 1000 for s in mine if s["outcome"] == "ok"]),
        "slo": {"target": targets.describe(cls), "attainment": share,
                "met": share is not None and share >= targets.goal},
    }


def online_beside_batches(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Online TTFT of the requests sent while a batch job was in flight (from its upload to
    its downloaded output) beside those sent while none was: what a person waiting pays for
    the batch work around them."""
    spans = [(s["start"], s["t"]) for s in samples if s.get("cls") == "batch" and s.get("name") == "batch job"]
    during: list[float] = []
    outside: list[float] = []
    for s in requests(samples, "online"):
        if s.get("ttft_ms") is None:
            continue
        busy = any(a <= s["start"] <= b for a, b in spans)
        (during if busy else outside).append(s["ttft_ms"])
    return {"batch_jobs": len(spans), "during": {**_pct(during), "n": len(during)},
            "outside": {**_pct(outside), "n": len(outside)}}


def summarize(samples: list[dict[str, Any]], tenants: list[dict[str, Any]],
              billed: dict[str, dict[str, int]], *, duration_s: float, targets: SloTargets,
              run: dict[str, Any]) -> dict[str, Any]:
    """The whole summary: `tenants` as `Tenant.public()` gives them, `billed` the usage
    report's sums per tenant name, `run` what was asked (users, mix, url, ...)."""
    class_users: Counter[str] = Counter()
    for t in tenants:
        class_users[t["cls"]] += t["users"]
    classes = {cls: class_summary(samples, cls, n, duration_s, targets)
               for cls, n in class_users.items() if n > 0}
    output: Counter[str] = Counter()
    seen: defaultdict[str, set[str]] = defaultdict(set)       # the users each tenant's requests came from
    for s in requests(samples):
        output[s["tenant"]] += s.get("completion_tokens") or 0
        seen[s["tenant"]].add(s.get("user"))
    fair = fairness(tenants, output, duration_s)
    books = accounting(billed, received_tokens([s for s in samples if s["tenant"] in billed]))
    failures = [s for s in requests(samples) if s["outcome"] == "failed"]
    verdicts = [
        _verdict("every class served", True, all(c["ok"] + c["expected"] > 0 for c in classes.values()),
                 ", ".join(f"{k} {c['ok'] + c['expected']}" for k, c in classes.items())),
        _verdict("no unexpected failures", True, not failures, f"{len(failures)} failed"),
        _verdict("quota accounting error 0", True, books["error_tokens"] == 0,
                 f"{books['error_tokens']} tokens"),
        *(_verdict(f"SLO {cls}", False, c["slo"]["met"],
                   f"{_fmt_share(c['slo']['attainment'])} >= {targets.goal:.0%} of requests: {c['slo']['target']}")
          for cls, c in classes.items()),
        *(_verdict(f"fairness {cls}", False, f["jain"] is not None and f["jain"] >= targets.fairness,
                   f"Jain {_fmt(f['jain'], 3)} >= {targets.fairness}") for cls, f in fair.items()),
    ]
    return {
        "run": {**run, "duration_s": duration_s},
        "targets": asdict(targets),
        "classes": classes,
        "tenants": [{**t, "users_seen": len(seen[t["name"]]), "output_tokens": output.get(t["name"], 0),
                     "output_tokens_per_s": output.get(t["name"], 0) / duration_s} for t in tenants],
        "fairness": fair,
        "online_beside_batches": online_beside_batches(samples),
        "accounting": books,
        "unexpected_failures": len(failures),
        "failure_examples": [{k: s.get(k) for k in ("cls", "name", "status", "error")} for s in failures[:5]],
        "verdicts": verdicts,
        "passed": all(v["passed"] for v in verdicts if v["hard"]),
    }


def _verdict(name: str, hard: bool, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "hard": hard, "passed": bool(passed), "detail": detail}


def _fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _fmt_share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def to_markdown(summary: dict[str, Any]) -> str:
    """The summary as Markdown: the classes' table, fairness, accounting, verdicts."""
    run = summary["run"]
    lines = [f"# Load test: {run['users']} users, {run['duration_s']:.0f} s, mix {run['mix']}", "",
             "| class | users | requests | ok | refused | expected refusals | failed | output tok/s "
             "| TTFT p50 / p99 ms | ITL p50 / p99 ms | SLO target | attainment |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for cls, c in summary["classes"].items():
        lines.append(
            f"| {cls} | {c['users']} | {c['requests']} | {c['ok']} | {c['refused']} | {c['expected']} "
            f"| {c['failed']} | {c['output_tokens_per_s']:.1f} "
            f"| {_fmt(c['ttft_ms']['p50'])} / {_fmt(c['ttft_ms']['p99'])} "
            f"| {_fmt(c['itl_ms']['p50'], 1)} / {_fmt(c['itl_ms']['p99'], 1)} "
            f"| {c['slo']['target']} | {_fmt_share(c['slo']['attainment'])} |")
    lines += ["", "| tenant | class | weight | users | output tok/s | billed prompt / completion "
              "| received prompt / completion | error |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    books = summary["accounting"]["tenants"]
    for t in summary["tenants"]:
        b = books.get(t["name"], {"billed": {}, "received": {}, "error_tokens": 0})
        lines.append(
            f"| {t['name']} | {t['cls']} | {t['weight']:g} | {t['users']} | {t['output_tokens_per_s']:.1f} "
            f"| {b['billed'].get('prompt_tokens', 0)} / {b['billed'].get('completion_tokens', 0)} "
            f"| {b['received'].get('prompt_tokens', 0)} / {b['received'].get('completion_tokens', 0)} "
            f"| {b['error_tokens']} |")
    lines += ["", "Jain's fairness index (output tokens/s per unit of weight, across a class's tenants): "
              + (", ".join(f"{cls} {_fmt(f['jain'], 3)}" + ("" if f["users_proportional"] else
                           " (users not proportional to weights)")
                           for cls, f in summary["fairness"].items()) or "-"),
              ""]
    ob = summary.get("online_beside_batches")
    if ob and ob["batch_jobs"]:
        d, o = ob["during"], ob["outside"]
        lines += [f"Online TTFT p50 / p99 while a batch job was in flight: {_fmt(d['p50'])} / {_fmt(d['p99'])} ms "
                  f"({d['n']} requests); while none was: {_fmt(o['p50'])} / {_fmt(o['p99'])} ms "
                  f"({o['n']} requests); {ob['batch_jobs']} batch jobs.", ""]
    lines += ["Verdicts:", ""]
    lines += [f"- {'PASS' if v['passed'] else 'FAIL'} {v['name']}: {v['detail']}"
              + ("" if v["hard"] else " (reported, not enforced)") for v in summary["verdicts"]]
    if summary["failure_examples"]:
        lines += ["", "Failures (the first few):", ""]
        lines += [f"- {f['cls']} `{f['name']}` ({f['status']}): {f['error']}" for f in summary["failure_examples"]]
    return "\n".join(lines) + "\n"
