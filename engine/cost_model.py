"""The step-cost model: what a step will take, fitted online from the steps the engine ran.

A step's time is modelled as linear in what it does:

    t = c0 + c1 * prefill tokens + c2 * sequences + c3 * KV tokens read by decodes
           + c4 * prefill attention (chunk x context, summed) + c5 * rows sampled

fitted by exponentially weighted least squares (old steps fade, so the model follows the
machine's load) with non-negative coefficients (each part of a step costs time), one model
per `EngineCore`, so per model and device. Fitting costs a 6x6 solve every few steps and no
allocation that grows. The scheduler asks it how long the step it is building will take
(`predict`) and how many more prefill tokens fit a time budget (`prefill_room`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from lockgate.engine.stats import CostModelStats

FEATURES = ("const", "prefill_tokens", "seqs", "decode_kv_tokens", "prefill_attention", "sampled")
# features are fitted in these units, so that each is about 1 in a typical step
_SCALE = (1.0, 256.0, 16.0, 16384.0, 256.0 * 1024.0, 16.0)
MIN_SAMPLES = 24          # steps observed before the model predicts
ERROR_WINDOW = 512        # recent predictions whose error is reported
REFIT_EVERY = 8           # steps between solves once the fit has settled


@dataclass(slots=True)
class StepShape:
    """What one step computes, as the cost model sees it."""

    prefill_tokens: int = 0
    num_seqs: int = 0
    decode_kv_tokens: int = 0     # context read by decodes (their KV tokens)
    prefill_attention: int = 0    # sum over prefill chunks of chunk x (context after it)
    sampled: int = 0              # rows that reach their end and are sampled

    def add_decode(self, context: int, sign: int = 1) -> None:
        self.num_seqs += sign
        self.decode_kv_tokens += sign * context
        self.sampled += sign

    def add_prefill(self, chunk: int, computed: int, samples: bool, sign: int = 1) -> None:
        self.num_seqs += sign
        self.prefill_tokens += sign * chunk
        self.prefill_attention += sign * chunk * (computed + chunk)
        self.sampled += sign * int(samples)

    def add_verify(self, num_tokens: int, computed: int, sign: int = 1) -> None:
        """A decode with draft tokens (speculative decoding): its last token and the drafts,
        computed as a prefill chunk is, every position sampled."""
        self.add_prefill(num_tokens, computed, False, sign)
        self.sampled += sign * num_tokens

    def features(self) -> tuple[float, ...]:
        raw = (1.0, self.prefill_tokens, self.num_seqs, self.decode_kv_tokens,
               self.prefill_attention, self.sampled)
        return tuple(v / s for v, s in zip(raw, _SCALE, strict=True))


class StepCostModel:
    def __init__(self, *, forget: float = 0.995, ridge: float = 1e-6) -> None:
        if not 0.0 < forget <= 1.0:
            raise ValueError(f"forget: must be in (0, 1], got {forget!r}")
        k = len(FEATURES)
        self.forget = forget
        self.ridge = ridge
        self._a = [[0.0] * k for _ in range(k)]     # weighted X^T X
        self._b = [0.0] * k                         # weighted X^T y
        self._w: list[float] | None = None          # coefficients in fitted units, seconds
        self.num_samples = 0
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)

    @property
    def ready(self) -> bool:
        return self._ready_weights() is not None

    def _ready_weights(self) -> list[float] | None:
        """The coefficients once enough steps were seen, else None."""
        return self._w if self.num_samples >= MIN_SAMPLES else None

    def predict(self, shape: StepShape) -> float | None:
        """Seconds the step will take; None until enough steps were seen."""
        w = self._ready_weights()
        if w is None:
            return None
        return max(0.0, sum(wi * x for wi, x in zip(w, shape.features(), strict=True)))

    def prefill_room(self, seconds: float, computed: int) -> int:
        """How many prefill tokens of a sequence with `computed` tokens already in the cache
        fit in `seconds` more of step time (its own overhead and sampling included)."""
        w = self._ready_weights()
        if w is None or seconds <= 0:
            return 0
        a = w[4] / _SCALE[4]
        b = w[1] / _SCALE[1] + w[4] * computed / _SCALE[4]
        c = w[2] / _SCALE[2] + w[5] / _SCALE[5]
        left = seconds - c
        if left <= 0:
            return 0
        if a > 0:
            n = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
        elif b > 0:
            n = left / b
        else:
            return 1 << 30
        return max(0, int(n))

    def chunk_time(self, num_tokens: int, computed: int = 0) -> float | None:
        """Seconds one more prefill chunk of `num_tokens` adds to a step (sampled at its end)."""
        w = self._ready_weights()
        if w is None:
            return None
        shape = StepShape()
        shape.add_prefill(num_tokens, computed, True)
        return sum(wi * x for wi, x in zip(w[1:], shape.features()[1:], strict=True))

    def observe(self, shape: StepShape, seconds: float, predicted: float | None = None) -> None:
        """Fold in one step that took `seconds`; `predicted` (what `predict` said before the
        step ran) goes into the reported error."""
        if not seconds > 0 or not math.isfinite(seconds):
            return
        if predicted is not None:
            self._errors.append(abs(predicted - seconds) / seconds)
        x = shape.features()
        weight = 1.0
        if predicted is not None and predicted > 0:
            # a step far off the fit (a neighbour took the core, a one-off cost) counts less
            ratio = seconds / predicted
            weight = min(1.0, 2.0 / max(ratio, 1.0 / ratio))
        f = self.forget
        a, b = self._a, self._b
        k = len(x)
        for i in range(k):
            xi = x[i] * weight
            row = a[i]
            for j in range(k):
                row[j] = f * row[j] + xi * x[j]
            b[i] = f * b[i] + xi * seconds
        self.num_samples += 1
        # the 6x6 solve is most of the cost: every step while young, then every REFIT_EVERY
        if self._w is None or self.num_samples < 2 * MIN_SAMPLES or self.num_samples % REFIT_EVERY == 0:
            self._w = _nonneg_lstsq(a, b, self.ridge)

    def coefficients(self) -> dict[str, float] | None:
        """Seconds per unit of each feature (per token, per sequence, ...)."""
        if self._w is None:
            return None
        return {name: w / s for name, w, s in zip(FEATURES, self._w, _SCALE, strict=True)}

    def prediction_error(self) -> float | None:
        """Median of |predicted - measured| / measured over the recent predicted steps."""
        return statistics.median(self._errors) if self._errors else None

    def summary(self, device: str = "") -> CostModelStats:
        return CostModelStats(samples=self.num_samples, ready=self.ready,
                              coefficients=self.coefficients(),
                              prediction_error_median=self.prediction_error(),
                              predictions=len(self._errors), device=device)


def _nonneg_lstsq(a: list[list[float]], b: list[float], ridge: float) -> list[float]:
    """Solve (A + ridge I) w = b with w >= 0: drop the features whose coefficient comes out
    negative and solve again over the rest (an active-set pass; a few rounds at most)."""
    k = len(b)
    active = list(range(k))
    scale = max(1e-30, max(a[i][i] for i in range(k)))
    while True:
        w_active = _solve([[a[i][j] for j in active] for i in active], [b[i] for i in active],
                          ridge * scale)
        w = [0.0] * k
        for idx, v in zip(active, w_active, strict=True):
            w[idx] = v
        negative = [i for i in active if w[i] < 0]
        if not negative:
            return w
        worst = min(negative, key=lambda i: w[i])
        active.remove(worst)


def _solve(a: list[list[float]], b: list[float], ridge: float) -> list[float]:
    """Gaussian elimination with partial pivoting on a copy of (A + ridge I | b)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for i in range(n):
        m[i][i] += ridge
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            continue
        m[col], m[piv] = m[piv], m[col]
        p = m[col][col]
        for r in range(col + 1, n):
            factor = m[r][col] / p
            if factor:
                row, prow = m[r], m[col]
                for c in range(col, n + 1):
                    row[c] -= factor * prow[c]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        p = m[i][i]
        if abs(p) < 1e-300:
            x[i] = 0.0
            continue
        x[i] = (m[i][n] - sum(m[i][j] * x[j] for j in range(i + 1, n))) / p
    return x
