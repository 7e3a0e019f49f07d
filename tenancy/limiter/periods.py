"""UTC calendar periods of the limiter's budgets: the day and month containing an instant
(`Periods.at`, remembered for the rest of that day) and the end of a named period."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta


@dataclass(frozen=True)
class Periods:
    """The UTC day and month containing an instant, with their bounds (epoch seconds)."""

    day: str
    day_start: float
    day_end: float
    month: str
    month_start: float
    month_end: float

    @classmethod
    def at(cls, ts: float) -> Periods:
        last = _last_periods[0]
        if last is not None and last.day_start <= ts < last.day_end:
            return last       # the same UTC day (hence month) as the last call: most calls
        p = cls._compute(ts)
        _last_periods[0] = p
        return p

    @classmethod
    def _compute(cls, ts: float) -> Periods:
        dt = datetime.fromtimestamp(ts, UTC)
        d0 = datetime(dt.year, dt.month, dt.day, tzinfo=UTC)
        m0 = datetime(dt.year, dt.month, 1, tzinfo=UTC)
        m1 = datetime(dt.year + (dt.month == 12), dt.month % 12 + 1, 1, tzinfo=UTC)
        return cls(
            day=d0.strftime("%Y-%m-%d"),
            day_start=d0.timestamp(),
            day_end=(d0 + timedelta(days=1)).timestamp(),
            month=m0.strftime("%Y-%m"),
            month_start=m0.timestamp(),
            month_end=m1.timestamp(),
        )


_last_periods: list[Periods | None] = [None]


def period_end(period: str) -> float:
    """End (epoch seconds) of a ``YYYY-MM-DD`` day or ``YYYY-MM`` month."""
    if len(period) == 10:
        d = datetime.strptime(period, "%Y-%m-%d").replace(tzinfo=UTC)
        return (d + timedelta(days=1)).timestamp()
    m = datetime.strptime(period, "%Y-%m").replace(tzinfo=UTC)
    return datetime(m.year + (m.month == 12), m.month % 12 + 1, 1, tzinfo=UTC).timestamp()

