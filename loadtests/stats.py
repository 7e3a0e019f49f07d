"""The one percentile the benchmarks compute, in the two conventions they report."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal


def percentile(values: Iterable[float], p: float,
               method: Literal["linear", "nearest"] = "linear") -> float:
    """The p-th percentile (0 <= p <= 100) of the values that are not NaN; NaN when none are.

    linear: interpolated between the closest ranks (numpy's default), what the engine
    benches report; nearest: the nearest-rank value (always one that was measured), what the
    gateway bench reports."""
    s = sorted(v for v in values if not math.isnan(v))
    if not s:
        return math.nan
    if method == "nearest":
        return s[max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))]
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
