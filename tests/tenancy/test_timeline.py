"""The console overview's timeline (`tenancy.usage.timeline`): per UTC hour and tier, requests,
tokens, errors and refusals, and nearest-rank TTFT p50/p99 of each hour and of the range, in
one statement, on SQLite and PostgreSQL alike; rows outside the range are left out."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from lockgate.tenancy.models import RefusalCount, Tenant, UsageRecord
from lockgate.tenancy.usage.timeline import hours_of, timeline

END = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
START = END - timedelta(hours=3)


def nearest_rank(values: list[float], p: int) -> float:
    ranked = sorted(values)
    return ranked[max(1, math.ceil(p / 100 * len(ranked))) - 1]


async def test_hours_and_tiers_in_one_statement(sessions):
    hour_a, hour_b = START + timedelta(minutes=10), START + timedelta(hours=2, minutes=30)
    ttfts_a = [float(v) for v in (40, 10, 30, 20, 50, 60, 70)]        # default tier, hour a
    async with sessions() as s:
        s.add(Tenant(id="ten_t", name="timeline"))
        await s.flush()
        rows = [("default", hour_a, t, "ok") for t in ttfts_a]
        rows += [("default", hour_a, None, "error"), ("flex", hour_b, 5.0, "ok"), ("flex", hour_b, 9.0, "error"),
                 ("default", hour_b, 100.0, "ok"),
                 ("default", START - timedelta(minutes=1), 1.0, "ok"), ("flex", END, 1.0, "ok")]   # outside
        for i, (tier, at, ttft, status) in enumerate(rows):
            s.add(UsageRecord(request_id=f"r{i}", tenant_id="ten_t", api_key_id="key_t", model="tiny",
                              service_tier=tier, prompt_tokens=10, cached_tokens=0, completion_tokens=i,
                              status=status, queue_ms=0.0, ttft_ms=ttft, total_ms=1.0, created_at=at))
        for tier, at, n in (("flex", hour_b, 4), ("flex", hour_b + timedelta(minutes=1), 2),
                            ("priority", hour_a, 1), ("flex", END + timedelta(minutes=5), 9)):
            s.add(RefusalCount(tenant_id="ten_t", api_key_id="key_t", scope="tenant", reason="requests_per_minute",
                               service_tier=tier, minute=at.replace(second=0, microsecond=0), count=n))
        await s.commit()

    seen: list[str] = []
    async with sessions() as s:
        from sqlalchemy import event
        sync = s.bind.sync_engine

        def count(*_a) -> None:
            seen.append("x")
        event.listen(sync, "before_cursor_execute", count)
        try:
            t = await timeline(s, start=START, end=END)
        finally:
            event.remove(sync, "before_cursor_execute", count)
    assert len(seen) == 1
    ha, hb = hour_a.strftime("%Y-%m-%d %H"), hour_b.strftime("%Y-%m-%d %H")
    assert t.hours == hours_of(START, END) == ["2026-12-06 09", "2026-12-06 10", "2026-12-06 11"]
    assert t.tiers == ["default", "flex", "priority"]
    a = t.buckets[(ha, "default")]
    assert (a.requests, a.errors, a.refusals) == (8, 1, 0)
    assert a.tokens == sum(10 + i for i in range(8))
    assert a.ttft_ms == {50: nearest_rank(ttfts_a, 50), 99: nearest_rank(ttfts_a, 99)} == {50: 40.0, 99: 70.0}
    b = t.buckets[(hb, "flex")]
    assert (b.requests, b.errors, b.refusals, b.ttft_ms) == (2, 1, 6, {50: 5.0, 99: 9.0})
    assert (t.buckets[(ha, "priority")].requests, t.buckets[(ha, "priority")].refusals) == (0, 1)
    assert t.series("flex", "refusals") == [0.0, 0.0, 6.0] and t.total("default", "requests") == 9
    assert t.series("default", "ttft_p50") == [40.0, 0.0, 100.0]
    # the range's percentiles per tier, not an average of the hours'
    assert t.ttft_ms["default"] == {50: nearest_rank([*ttfts_a, 100.0], 50), 99: 100.0}
    assert t.ttft_ms["flex"] == {50: 5.0, 99: 9.0}
