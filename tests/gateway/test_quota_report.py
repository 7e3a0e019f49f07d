"""Quota reports over HTTP, on the gateway in process (the fake engine) on PostgreSQL and
Redis: usage grouped
by tenant, key, model, tier and day (JSON, CSV, pages), and the quota report (each limit
beside its live use from the limiter, and the 429s each limit refused, counted in memory and
flushed to `refusal_counts` every 0.1 s here), for the admin and for a tenant's own key."""

from __future__ import annotations

import asyncio
import csv
import io
import time
from datetime import datetime

import httpx
import pytest
import pytest_asyncio

from tests.support.inprocess_gateway import running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
          "daily_token_budget", "monthly_token_budget")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tmp_path_factory):
    async with running_gateway(tmp_path_factory.mktemp("quota"), "services",
                               refusal_flush_interval_s=0.1) as gw:
        yield gw


async def key_for(server, tenant_id: str, **quota) -> str:
    r = await server.admin.post(f"/tenants/{tenant_id}/keys", json={"name": "k2", "quota": quota or None})
    assert r.status_code == 201, r.text
    return r.json()["key"]


async def complete(server, key: str, max_tokens: int = 2, **extra) -> httpx.Response:
    return await server.http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                  json={"model": "tiny", "prompt": "hi", "max_tokens": max_tokens, **extra})


async def get(server, path: str, key: str, **params) -> httpx.Response:
    return await server.http.get(path, params=params, headers={"Authorization": f"Bearer {key}"})


async def report_until(server, tenant_id: str, done, seconds: float = 5.0) -> dict:
    """The admin's report of one tenant, once `done(report)` holds (flushes run every 0.1 s)."""
    deadline = time.monotonic() + seconds
    while True:
        r = await server.admin.get("/quotas/report", params={"tenant_id": tenant_id})
        assert r.status_code == 200, r.text
        [entry] = r.json()["data"]
        if done(entry) or time.monotonic() > deadline:
            return entry
        await asyncio.sleep(0.05)


async def test_rpm_refusals_are_counted_and_used_remaining_match(server):
    """A tenant allowed 2 requests a minute sends 5: 2 answered, 3 refused (429) and counted
    under its rpm; its rpm shows 2 used of 2, and its daily budget the tokens the 2 used."""
    t, key = await server.tenant(quota={"requests_per_minute": 2, "daily_token_budget": 1000})
    answers = [await complete(server, key) for _ in range(5)]
    assert [r.status_code for r in answers] == [200, 200, 429, 429, 429], answers[-1].text
    spent = sum(r.json()["usage"]["total_tokens"] for r in answers[:2])
    entry = await report_until(server, t["id"], lambda e: e["limits"]["requests_per_minute"]["refused"] == 3
                               and e["limits"]["daily_token_budget"]["used"] == spent)
    rpm, day = entry["limits"]["requests_per_minute"], entry["limits"]["daily_token_budget"]
    assert (rpm["limit"], rpm["used"], rpm["remaining"], rpm["refused"]) == (2, 2, 0, 3)
    resets = datetime.fromisoformat(rpm["resets_at"]).timestamp()
    assert time.time() < resets <= time.time() + 60
    assert (day["limit"], day["used"], day["remaining"]) == (1000, spent, 1000 - spent)
    assert datetime.fromisoformat(day["resets_at"]).time() == datetime.min.time()  # midnight UTC
    assert entry["limits"]["tokens_per_minute"] == {"limit": None, "used": None, "remaining": None,
                                                    "resets_at": None, "refused": 0}
    assert entry["refused"] == {**dict.fromkeys(FIELDS, 0), "requests_per_minute": 3}
    [k] = entry["keys"]
    assert k["refused"]["requests_per_minute"] == 3                # the key's 429s, by the tenant's limit
    assert k["limits"]["requests_per_minute"]["refused"] == 0      # its own limit refused none
    # the tenant reads the same of itself; a range before the refusals holds none
    mine = await get(server, "/v1/usage/quota", key)
    assert mine.status_code == 200, mine.text
    assert mine.json()["data"][0]["limits"]["requests_per_minute"]["refused"] == 3
    old = await get(server, "/v1/usage/quota", key, start="2020-01-01T00:00:00Z", end="2020-01-02T00:00:00Z")
    assert old.json()["data"][0]["refused"]["requests_per_minute"] == 0


async def test_budget_and_key_limit_refusals_count_under_their_own_reasons(server):
    """A daily budget of 30 tokens refuses a request reserving 2 + 50 (insufficient_quota);
    a key allowed 1 request a minute has its second refused by its own rpm, not the tenant's."""
    t, key = await server.tenant(quota={"daily_token_budget": 30})
    r = await complete(server, key, max_tokens=50)
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota", r.text
    slow = await key_for(server, t["id"], requests_per_minute=1)
    assert (await complete(server, slow)).status_code == 200
    assert (await complete(server, slow)).status_code == 429
    entry = await report_until(server, t["id"], lambda e: sum(e["refused"].values()) == 2)
    assert entry["refused"] == {**dict.fromkeys(FIELDS, 0), "daily_token_budget": 1,
                                "requests_per_minute": 1}
    assert entry["limits"]["daily_token_budget"]["refused"] == 1
    assert entry["limits"]["requests_per_minute"]["refused"] == 0       # the key's limit refused
    keys = {k["name"]: k for k in entry["keys"]}
    assert keys["k2"]["limits"]["requests_per_minute"] == {
        "limit": 1, "used": 1, "remaining": 0, "refused": 1,
        "resets_at": keys["k2"]["limits"]["requests_per_minute"]["resets_at"]}
    assert keys["k"]["refused"]["daily_token_budget"] == 1


async def test_a_tenant_sees_only_its_own_quotas(server):
    a, key_a = await server.tenant(quota={"requests_per_minute": 100})
    b, _ = await server.tenant(quota={"requests_per_minute": 100})
    r = await get(server, "/v1/usage/quota", key_a, tenant_id=b["id"])
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
    assert b["id"] not in r.text
    r = await get(server, "/v1/usage/quota", key_a, tenant_id=a["id"])
    assert r.status_code == 200 and [e["tenant_id"] for e in r.json()["data"]] == [a["id"]]
    assert b["id"] not in r.text
    for params in ({"limit": "5"}, {"after": b["id"]}):        # admin-only parameters: 400
        assert (await get(server, "/v1/usage/quota", key_a, **params)).status_code == 400
    assert (await get(server, "/admin/v1/quotas/report", key_a)).status_code == 403
    assert (await server.http.get("/admin/v1/quotas/report")).status_code == 401
    assert (await get(server, "/v1/usage/quota", server.admin_key)).status_code == 403
    assert (await server.admin.get("/quotas/report", params={"tenant_id": "ten_0000000000000000"})).status_code == 404


async def test_admin_quota_report_pages_through_every_tenant(server):
    ids = {(await server.tenant())[0]["id"] for _ in range(3)}
    seen, after = [], None
    while True:
        r = await server.admin.get("/quotas/report", params={"limit": 2, **({"after": after} if after else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        assert len(body["data"]) <= 2
        seen += [e["tenant_id"] for e in body["data"]]
        if not body["has_more"]:
            break
        after = body["last_id"]
    assert len(seen) == len(set(seen)) and ids <= set(seen) and seen == sorted(seen)
    assert (await server.admin.get("/quotas/report", params={"limit": 101})).status_code == 400


async def test_usage_groups_by_tenant_and_key_in_json_csv_and_pages(server):
    """Two keys, each one default and one flex request: 4 groups by key and tier."""
    t, key1 = await server.tenant()
    key2 = await key_for(server, t["id"])
    for key in (key1, key2):
        for tier in ("default", "flex"):
            assert (await complete(server, key, service_tier=tier)).status_code == 200
    params = {"tenant_id": t["id"], "group_by": "tenant,key,service_tier"}
    whole = (await server.admin.get("/usage", params=params)).json()
    assert whole["group_by"] == "tenant,key,service_tier" and not whole["has_more"]
    groups = [e["group"] for e in whole["data"]]
    assert len(groups) == 4 and all(g["tenant"] == t["id"] for g in groups)
    assert sorted({g["service_tier"] for g in groups}) == ["default", "flex"]
    assert len({g["key"] for g in groups}) == 2
    assert all(e["requests"] == 1 for e in whole["data"])
    by_tenant = (await server.admin.get("/usage", params={"tenant_id": t["id"], "group_by": "tenant"})).json()
    assert [(e["group"], e["requests"]) for e in by_tenant["data"]] == [(t["id"], 4)]
    assert by_tenant["data"][0]["total_tokens"] == sum(e["total_tokens"] for e in whole["data"])

    pages, after = [], None
    while True:
        r = await server.admin.get("/usage", params={**params, "limit": 1, **({"after": after} if after else {})})
        page = r.json()
        pages += page["data"]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == whole["data"]

    r = await server.admin.get("/usage", params={**params, "format": "csv", "limit": 3})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert r.headers["x-has-more"] == "true" and r.headers["x-last-id"]
    lines = list(csv.DictReader(io.StringIO(r.text)))
    assert list(lines[0])[:4] == ["tenant", "key", "service_tier", "requests"]
    assert [(x["key"], x["service_tier"]) for x in lines] == [(g["key"], g["service_tier"]) for g in groups[:3]]

    # the tenant's own report by key: its groups only
    mine = (await get(server, "/v1/usage", key1, group_by="key,service_tier")).json()
    assert [e["group"] for e in mine["data"]] == [{k: g[k] for k in ("key", "service_tier")} for g in groups]


@pytest.mark.parametrize(("params", "param"), [
    ({"group_by": "week"}, "group_by"), ({"group_by": "tenant,tenant"}, "group_by"),
    ({"group_by": "model", "after": "!!"}, "after"), ({"limit": "0"}, "limit"),
    ({"limit": "1001"}, "limit")])
async def test_bad_usage_queries_are_400s_naming_the_field(server, params, param):
    r = await server.admin.get("/usage", params=params)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
