"""The console's models, quota and live engine pages in this process (fake engine): the
models page is /admin/v1/models and /admin/v1/adapters (an adapter unloaded through the
console as through the API, a viewer offered no form); the quota page shows the API's quota
report (limits, use, refusals per limit) for the same query; the engine fragment shows every
class, tenant, queue bound, shed, cost model target and pool worker of /admin/v1/engine."""

from __future__ import annotations

import asyncio
import re

import pytest
import pytest_asyncio

from lockgate.engine import (
    CostModelStats,
    EngineStats,
    KVStats,
    OverloadStats,
    QueueBounds,
    QueueStats,
    TenantClassStats,
)
from lockgate.gateway.state import AppState
from lockgate.tenancy import adapters
from tests.gateway.test_console import admin_key, csrf, sign_in
from tests.support.inprocess_gateway import InProcessGateway, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory) -> InProcessGateway:
    async with running_gateway(tmp_path_factory.mktemp("pages"), "embedded", engine="fake",
                               console_sign_ins_per_minute=1000, refusal_flush_interval_s=0.1) as g:
        yield g


def state(gw: InProcessGateway) -> AppState:
    return gw.app.state.lockgate


async def adapter_row(gw: InProcessGateway, name: str) -> str:
    """An adapter's row (the fake engine reads no adapter files; the row is what the pages list)."""
    async with state(gw).sessions() as session:
        a = await adapters.create_adapter(session, name=name, base_model="tiny", owner_tenant_id=None,
                                          path=name, rank=8, targets=["q_proj"], actor="test")
        await session.commit()
        return a.id


def cells(html: str, row: str) -> list[str]:
    m = re.search(rf"<tr {row}[^>]*>(.*?)</tr>", html, re.S)
    assert m, (row, html[:3000])
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", m.group(1), re.S)]


async def test_the_models_page_is_the_apis_listing(gw):
    c = await sign_in(gw, gw.admin_key)
    ada = await adapter_row(gw, "ada-pages")
    page = await c.get("/console/models")
    assert page.status_code == 200, page.text
    api = (await gw.admin.get("/models")).json()
    tiny = next(m for m in api["data"] if m["id"] == "tiny")
    row = cells(page.text, 'data-model="tiny"')
    assert row[1] == ("yes" if tiny["resident"] else "offloaded") and row[3:5] == [str(tiny["waiting"]),
                                                                                   str(tiny["running"])]
    assert ada in cells(page.text, f'data-adapter="{ada}"')[1]
    # unloading through the console: the API's unload, a redirect back to the page
    r = await c.post(f"/console/adapters/{ada}/unload", data={"csrf": csrf(page)})
    assert r.status_code == 303, r.text
    assert (await gw.admin.post(f"/adapters/{ada}/unload")).json()["unloaded"] is False
    # registering: the fake engine reads no adapter, so the engine's refusal, a 400 naming the field
    r = await c.post("/console/adapters", data={"name": "ada-new", "base_model": "tiny", "path": "nowhere",
                                                "csrf": csrf(page)})
    assert r.status_code == 400 and "path" in r.text, r.text
    r = await c.post("/console/adapters", data={"name": "ada-new", "base_model": "huge", "path": "x",
                                                "csrf": csrf(page)})
    assert r.status_code == 400 and "base_model" in r.text, r.text


async def test_a_viewer_sees_models_and_quotas_and_no_form(gw):
    _, key = await admin_key(gw, "viewer", name="pages-viewer")
    c = await sign_in(gw, key)
    ada = await adapter_row(gw, "ada-viewer")
    for path in ("/console/models", "/console/quotas"):
        r = await c.get(path)
        assert r.status_code == 200, r.text
        assert re.findall(r'<form[^>]* method="post" action="([^"]+)"', r.text) == ["/console/sign-out"], path
    token = csrf(await c.get("/console/"))
    assert (await c.post(f"/console/adapters/{ada}/unload", data={"csrf": token})).status_code == 403
    assert (await c.post("/console/adapters", data={"name": "v", "base_model": "tiny", "path": "x",
                                                    "csrf": token})).status_code == 403


async def test_the_quota_page_is_the_apis_report(gw):
    c = await sign_in(gw, gw.admin_key)
    t, key = await gw.tenant(quota={"requests_per_minute": 2, "daily_token_budget": 10_000})
    codes = [(await gw.http.post("/v1/completions", headers=gw.auth(key),
                                 json={"model": "tiny", "prompt": "hi", "max_tokens": 2})).status_code
             for _ in range(4)]
    assert codes.count(429) == 2, codes
    for _ in range(100):         # refusals are flushed every 0.1 s here
        api = (await gw.admin.get("/quotas/report", params={"tenant_id": t["id"]})).json()
        if api["data"][0]["limits"]["requests_per_minute"]["refused"] == 2:
            break
        await asyncio.sleep(0.05)
    page = await c.get("/console/quotas", params={"tenant_id": t["id"]})
    assert page.status_code == 200, page.text
    mine = api["data"][0]["limits"]
    for name, lim in mine.items():
        row = cells(page.text, f'data-limit="{name}"')
        want = [str(lim["limit"]) if lim["limit"] is not None else "no limit",
                str(lim["used"]) if lim["used"] is not None else "—",
                str(lim["remaining"]) if lim["remaining"] is not None else "—"]
        assert row[1:4] == want and row[5] == str(lim["refused"]), (name, row, lim)
    assert cells(page.text, 'data-limit="requests_per_minute"')[5] == "2"
    everyone = await c.get("/console/quotas")
    assert everyone.status_code == 200 and f'data-tenant="{t["id"]}"' in everyone.text
    assert (await c.get("/console/quotas", params={"start": "yesterday"})).status_code == 400


def overview_rows(html: str) -> dict[str, list[str]]:
    return {tier: cells(html, f'data-tier="{tier}"') for tier in re.findall(r'<tr data-tier="([^"]+)"', html)}


async def test_the_overview_charts_requests_and_refusals_per_tier(gw):
    """The overview's per-tier totals and charts move with the requests: a 429 is counted in
    the tier the request asked for, or, refused before its body was read (a large body), in
    its tenant's default tier."""
    c = await sign_in(gw, gw.admin_key)
    before = overview_rows((await c.get("/console/")).text)
    _, key = await gw.tenant(quota={"requests_per_minute": 2}, service_tiers=["default", "flex", "priority"],
                             default_tier="priority")
    small = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "service_tier": "flex"}
    codes = [(await gw.http.post("/v1/completions", headers=gw.auth(key), json=small)).status_code
             for _ in range(3)]
    large = {**small, "prompt": "hi " * 9000}          # past the small-body bound: refused unread
    codes.append((await gw.http.post("/v1/completions", headers=gw.auth(key), json=large)).status_code)
    assert codes == [200, 200, 429, 429], codes
    for _ in range(100):         # refusals are flushed every 0.1 s here
        page = await c.get("/console/")
        rows = overview_rows(page.text)
        if int(rows.get("priority", [0] * 5)[4]) > int(before.get("priority", [0] * 5)[4]):
            break
        await asyncio.sleep(0.05)
    assert page.status_code == 200, page.text

    def delta(tier: str, col: int) -> int:
        return int(rows.get(tier, [0] * 7)[col]) - int(before.get(tier, [0] * 7)[col])
    # requests, errors, refusals
    assert [delta("flex", i) for i in (1, 3, 4)] == [2, 0, 1], (before, rows)
    assert [delta("priority", i) for i in (1, 4)] == [0, 1], (before, rows)
    assert rows["flex"][5].endswith(" ms")           # TTFT p50 of the tier's day
    charts = re.findall(r'<figure class="card chart-card" data-chart="([^"]+)"><figcaption>[^<]*</figcaption>'
                        r'<svg class="chart"', page.text)
    assert charts == ["Requests", "Tokens (prompt + completion)", "Errors", "Refusals (429s of a limit)",
                      "TTFT p50", "TTFT p99"], charts
    assert page.text.count('<polyline fill="none" stroke="#2e7d32"') == 6     # flex: a line in each chart
    assert "style=" not in page.text                                         # the CSP allows none


def _busy(worker: str | None = None) -> EngineStats:
    flex = TenantClassStats(waiting=7, running=2, decode_tokens=40)
    return EngineStats(
        classes={"online": QueueStats(running=1), "offline": QueueStats(waiting=7, running=2, preemptions=3)},
        tenants={"ten_flood": {"offline": flex}}, running={"online": 1, "offline": 2},
        waiting={"online": 0, "offline": 7}, waiting_requests={"online": 0, "offline": 7},
        num_preemptions=3, kv=KVStats(total=100, used=61, free=39),
        cost_model=CostModelStats(samples=50, ready=True, coefficients={"decode": 1e-4},
                                  prediction_error_median=0.08, predictions=40,
                                  step_targets={"online": 0.05, "offline": None}, last_urgent_class="online",
                                  last_step_target_s=0.05),
        overload=OverloadStats(queued={"offline": 7}, queued_tokens=900, bounds=QueueBounds(64, 4096, None),
                               refused={"offline": {"ten_flood": 4}}, shed={"offline": {"ten_flood": 5}}),
        by_worker={} if worker else {"w0": _busy("w0"), "w1": _busy("w1")})


async def test_the_live_engine_fragment_shows_classes_tenants_and_workers(gw, monkeypatch):
    c = await sign_in(gw, gw.admin_key)
    monkeypatch.setattr(type(state(gw).models), "engine_stats", lambda self: [("tiny", _busy())])
    r = await c.get("/console/engine/live")
    assert r.status_code == 200 and "<html" not in r.text      # the fragment alone
    html = r.text
    assert cells(html, 'data-class="offline" data-tier="flex"') == ["offline (flex)", "7", "2", "7", "3", "4", "5"]
    assert cells(html, 'data-tenant="ten_flood" data-class="offline" data-tier="flex"')[2:4] == ["7", "2"]
    assert html.count('data-tenant="ten_flood"') == 3            # the model and each pool worker
    assert 'data-engine="tiny · worker w0"' in html and 'data-engine="tiny · worker w1"' in html
    assert "61 used of 100" in html and "online\n      50.0 ms" in html and "offline\n      from the decodes" in html
    assert "latest step (online): 50.0 ms" in html and "median error 8.0 %" in html
    page = await c.get("/console/engine")
    assert 'data-poll="/console/engine/live"' in page.text and "<html" in page.text


async def test_a_tenant_page_shows_whether_its_plan_speculates(gw):
    """The plan's speculative flag, as the API sets it, on the tenant's page."""
    _, key = await admin_key(gw, "admin", name="pages-spec")
    c = await sign_in(gw, key)
    for flag, shown in ((False, "off for every request"), (True, "allowed")):
        r = await gw.admin.post("/tenants", json={"name": f"spec-{flag}", "speculative": flag})
        assert r.status_code in (200, 201), r.text
        page = (await c.get(f"/console/tenants/{r.json()['id']}")).text
        fact = re.search(r"<dt>Speculative decoding</dt><dd>([^<]*)</dd>", page)
        assert fact and fact.group(1) == shown
