"""Usage reports grouped by any of tenant, key, model, service tier and day together, a page
at a time, on SQLite and PostgreSQL (`tenancy.usage.report.usage_page`)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from lockgate.tenancy import tenants
from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.usage.report import parse_group_by, usage_page, usage_report
from lockgate.tenancy.usage.writer import UsageRow, UsageWriter

D1 = datetime(2024, 3, 1, 10, 0, tzinfo=UTC)


def row(i: int, tenant_id: str, key_id: str, model: str, tier: str, day: int,
        prompt: int) -> UsageRow:
    return UsageRow(f"r{i}", tenant_id, key_id, model, tier, prompt, 0, 1, "ok", 1.0,
                    float(prompt), 5.0, D1 + timedelta(days=day, minutes=i))


@pytest.fixture
async def rows(sessions) -> list[UsageRow]:
    """36 rows: 2 tenants x 2 keys x 3 models x 3 (tier, day) pairs, prompt = 1..36."""
    async with sessions() as s:
        a = await tenants.create_tenant(s, name="a", actor="test")
        b = await tenants.create_tenant(s, name="b", actor="test")
    out = []
    combos = itertools.product([(a.id, "key_a1"), (a.id, "key_a2"), (b.id, "key_b1"), (b.id, "key_b2")],
                               ["m1", "m2", "m3"], [("default", 0), ("flex", 0), ("priority", 1)])
    for i, ((tid, kid), model, (tier, day)) in enumerate(combos):
        out.append(row(i, tid, kid, model, tier, day, prompt=i + 1))
    async with UsageWriter(sessions) as w:
        for r in out:
            await w.record(r)
    return out


def expected(rows: list[UsageRow], groups: tuple[str, ...]) -> dict[tuple, tuple[int, int]]:
    """(group values) -> (requests, prompt tokens), computed from the rows themselves."""
    attr = {"tenant": lambda r: r.tenant_id, "key": lambda r: r.api_key_id,
            "model": lambda r: r.model, "service_tier": lambda r: r.service_tier,
            "day": lambda r: r.created_at.date().isoformat()}
    out: dict[tuple, tuple[int, int]] = {}
    for r in rows:
        k = tuple(attr[g](r) for g in groups)
        n, p = out.get(k, (0, 0))
        out[k] = (n + 1, p + r.prompt_tokens)
    return out


def key_of(entry: dict, groups: tuple[str, ...]) -> tuple:
    g = entry["group"]
    return (g,) if len(groups) == 1 else tuple(g[name] for name in groups)


@pytest.mark.parametrize("group_by", ["tenant", "key", "tenant,key", "key,model",
                                      "tenant,model,service_tier,day", "day,tenant",
                                      "tenant,key,model,service_tier,day"])
async def test_groups_combine_and_sums_match_the_rows(sessions, rows, group_by):
    groups = parse_group_by(group_by)
    async with sessions() as s:
        report = await usage_report(s, group_by=group_by)
    got = {key_of(e, groups): (e["requests"], e["prompt_tokens"]) for e in report}
    assert got == expected(rows, groups)
    assert [key_of(e, groups) for e in report] == sorted(got)        # in group order
    assert sum(e["requests"] for e in report) == 36
    if len(groups) > 1:
        assert list(report[0]["group"]) == list(groups)                # {name: value}, in order


async def test_one_tenant_by_key_and_day(sessions, rows):
    """tenant_id still filters: tenant a's 18 rows, per key and day: 6 + 3 on each key."""
    tid = rows[0].tenant_id
    async with sessions() as s:
        report = await usage_report(s, tenant_id=tid, group_by="key,day")
    assert [(e["group"]["key"], e["group"]["day"], e["requests"]) for e in report] == [
        ("key_a1", "2024-03-01", 6), ("key_a1", "2024-03-02", 3),
        ("key_a2", "2024-03-01", 6), ("key_a2", "2024-03-02", 3)]


@pytest.mark.parametrize(("group_by", "limit"), [("tenant,key,model,service_tier", 5),
                                                 ("day,key", 3), ("model", 1), ("day", 7)])
async def test_pages_walk_every_group_once(sessions, rows, group_by, limit):
    """Keyset pages of `limit`: together exactly the groups of the whole report, each once,
    with the same totals and TTFT percentiles (a page's TTFTs are its groups' alone)."""
    async with sessions() as s:
        whole = await usage_report(s, group_by=group_by)
        pages, after = [], None
        while True:
            page = await usage_page(s, group_by=group_by, limit=limit, after=after)
            assert len(page.data) <= limit
            pages.append(page)
            if not page.has_more:
                break
            after = page.last
            assert len(pages) < 100
    walked = [e for p in pages for e in p.data]
    assert walked == whole
    assert len(pages) == -(-len(whole) // limit)
    assert all(len(p.data) == limit for p in pages[:-1])


async def test_bad_group_by_and_cursor_name_their_field(sessions, rows):
    for bad in ("week", "tenant,week", "model,model", "tenant,,key", ["tenant", 3]):
        with pytest.raises(Invalid) as info:
            parse_group_by(bad)
        assert info.value.field == "group_by", bad
    async with sessions() as s:
        with pytest.raises(Invalid) as info:
            await usage_page(s, group_by="tenant,key", limit=2, after=["only-one"])
        assert info.value.field == "after"
        with pytest.raises(Invalid) as info:
            await usage_page(s, group_by="day", limit=2, after=["not-a-day"])
        assert info.value.field == "after"
        with pytest.raises(Invalid) as info:
            await usage_page(s, group_by="day", limit=0)
        assert info.value.field == "limit"
