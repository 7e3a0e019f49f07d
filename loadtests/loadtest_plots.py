"""`lockgate loadtest`'s plots (matplotlib, Agg), from the per-request samples: TTFT p50/p99
per class over time, output tokens/s per class and per tenant, and the rates of refusals and
failures. Time is seconds since the run started, in bins of a thirtieth of the run (2 s at
least). A request's TTFT counts in the bin it started in, a refusal or failure in the bin it
ended in, and its output tokens are spread evenly over the time it produced them (first
token to end for a stream; start to end for a whole answer or a batch)."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from lockgate.loadtests.loadtest_summary import requests
from lockgate.loadtests.stats import percentile

COLOURS = {"online": "tab:blue", "offline": "tab:orange", "batch": "tab:green", "bad": "tab:red"}
TENANT_STYLES = ("-", "--", ":", "-.")


class Bins:
    """Equal time bins over [t0, t0 + duration_s]."""

    def __init__(self, t0: float, duration_s: float) -> None:
        self.t0 = t0
        self.width = max(2.0, duration_s / 30)
        self.num = max(1, math.ceil(duration_s / self.width))
        self.centres = [(i + 0.5) * self.width for i in range(self.num)]

    def index(self, t: float) -> int:
        return min(self.num - 1, max(0, int((t - self.t0) // self.width)))

    def percentiles(self, samples: list[dict[str, Any]], p: float) -> tuple[list[float], list[float]]:
        """p-th percentile of ttft_ms per bin of start time; empty bins left out."""
        binned: dict[int, list[float]] = defaultdict(list)
        for s in samples:
            binned[self.index(s["start"])].append(s["ttft_ms"])
        xs = [self.centres[i] for i in sorted(binned)]
        return xs, [percentile(binned[i], p, method="nearest") for i in sorted(binned)]

    def rate(self, samples: list[dict[str, Any]]) -> list[float]:
        """Samples ended per second, per bin."""
        counts = [0.0] * self.num
        for s in samples:
            counts[self.index(s["t"])] += 1
        return [c / self.width for c in counts]

    def token_rate(self, samples: list[dict[str, Any]]) -> list[float]:
        """Output tokens per second, per bin, each request's spread over its producing time."""
        tokens = [0.0] * self.num
        for s in samples:
            n = s.get("completion_tokens") or 0
            a = s["start"] + (s.get("ttft_ms") or 0) / 1000
            b = max(a, s["t"])
            if b - a < 1e-6:
                tokens[self.index(b)] += n
                continue
            for i in range(self.index(a), self.index(b) + 1):
                lo, hi = self.t0 + i * self.width, self.t0 + (i + 1) * self.width
                tokens[i] += n * max(0.0, min(b, hi) - max(a, lo)) / (b - a)
        return [x / self.width for x in tokens]


def plot_all(samples: list[dict[str, Any]], out_dir: Path, *, t0: float, duration_s: float) -> list[Path]:
    """Write ttft.png, throughput.png and errors.png into `out_dir`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reqs = requests(samples)
    bins = Bins(t0, duration_s)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=80)
    for cls in ("online", "offline"):
        mine = [s for s in reqs if s["cls"] == cls and s.get("ttft_ms") is not None]
        for p, style in ((50, "-"), (99, "--")):
            xs, ys = bins.percentiles(mine, p)
            if xs:
                ax.plot(xs, ys, style, marker=".", color=COLOURS[cls], label=f"{cls} p{p}")
    ax.set(title="Time to first token", xlabel="s since start", ylabel="ms")
    paths.append(_save(fig, out_dir / "ttft.png", ax))

    fig, (by_class, by_tenant) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=80, sharey=True)
    producing = [s for s in reqs if s.get("completion_tokens")]
    for cls in COLOURS:
        mine = [s for s in producing if s["cls"] == cls]
        if mine:
            by_class.plot(bins.centres, bins.token_rate(mine), color=COLOURS[cls], label=cls)
        tenants = sorted({s["tenant"] for s in mine})
        for tenant, style in zip(tenants, TENANT_STYLES * 4, strict=False):
            by_tenant.plot(bins.centres, bins.token_rate([s for s in mine if s["tenant"] == tenant]), style,
                           color=COLOURS[cls], label=tenant.split("-", 3)[-1])
    by_class.set(title="Output tokens/s per class", xlabel="s since start", ylabel="tokens/s")
    by_tenant.set(title="Output tokens/s per tenant", xlabel="s since start")
    paths.append(_save(fig, out_dir / "throughput.png", by_class, by_tenant))

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=80)
    kinds = (("429 refused (well-behaved users)", lambda s: s["status"] == 429 and s["outcome"] == "refused"),
             ("503 refused", lambda s: s["status"] == 503),
             ("429 expected (over quota)", lambda s: s["status"] == 429 and s["outcome"] == "expected"),
             ("401/413 expected (bad key, oversized)", lambda s: s["status"] in (401, 413)
              and s["outcome"] == "expected"),
             ("failures", lambda s: s["outcome"] == "failed"))
    for label, pick in kinds:
        ax.plot(bins.centres, bins.rate([s for s in reqs if pick(s)]), marker=".", label=label)
    ax.set(title="Refusals and failures", xlabel="s since start", ylabel="per s")
    paths.append(_save(fig, out_dir / "errors.png", ax))
    plt.close("all")
    return paths


def _save(fig, path: Path, *axes) -> Path:
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path
