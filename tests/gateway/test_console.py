"""The admin console in this process (httpx through ASGI, on the fake engine): sign-in with an
admin key (a tenant key refused, attempts limited and audited, the key never written), the
session (cookie flags, revoked with its key, signed out), CSRF (a POST without the token is a
403), the CSP on every answer, key names escaped, and a viewer key seeing pages and changing
nothing. The role table against the API is tests/gateway/test_console_roles.py; the browser
runs it in tests/e2e/test_console_browser.py."""

from __future__ import annotations

import asyncio
import re
import secrets

import httpx
import pytest
import pytest_asyncio

from tests.support.inprocess_gateway import InProcessGateway, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

CSRF = re.compile(r'name="csrf" value="([0-9a-f]{64})"')


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory) -> InProcessGateway:
    async with running_gateway(tmp_path_factory.mktemp("console"), "embedded", engine="fake",
                               console_sign_ins_per_minute=1000) as g:
        yield g


def csrf(page: httpx.Response) -> str:
    m = CSRF.search(page.text)
    assert m, page.text[:2000]
    return m.group(1)


async def sign_in(gw: InProcessGateway, key: str, client: httpx.AsyncClient | None = None) -> httpx.AsyncClient:
    c = client or gw.client()
    form = await c.get("/console/sign-in")
    assert form.status_code == 200, form.text
    r = await c.post("/console/sign-in", data={"key": key, "csrf": csrf(form)})
    assert r.status_code == 303, r.text
    return c


async def admin_key(gw: InProcessGateway, role: str = "admin", name: str = "ops") -> tuple[str, str]:
    r = await gw.admin.post("/keys", json={"name": name, "scopes": [role]})
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


async def test_sign_in_sets_a_strict_session_cookie_and_audits_without_the_key(gw):
    c = gw.client()
    form = await c.get("/console/sign-in")
    r = await c.post("/console/sign-in", data={"key": gw.admin_key, "csrf": csrf(form)})
    assert r.status_code == 303 and r.headers["location"] == "/console/"
    cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("lockgate_console="))
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/console" in cookie
    assert "Secure" not in cookie                      # plain http here; https sets it
    page = await c.get("/console/")
    assert page.status_code == 200 and "Overview" in page.text
    audit = (await gw.admin.get("/audit", params={"action": "console.sign_in"})).json()["data"]
    assert audit and audit[0]["actor"].startswith("key_")
    everything = (await gw.admin.get("/audit", params={"limit": 1000})).text
    assert gw.admin_key not in everything and gw.admin_key[3:] not in everything


async def test_a_tenant_key_and_a_wrong_key_are_refused_and_audited(gw):
    _, tenant_key = await gw.tenant()
    c = gw.client()
    form = await c.get("/console/sign-in")
    r = await c.post("/console/sign-in", data={"key": tenant_key, "csrf": csrf(form)})
    assert r.status_code == 403 and "tenant" in r.text
    r = await c.post("/console/sign-in", data={"key": "lg-" + secrets.token_urlsafe(32), "csrf": csrf(form)})
    assert r.status_code == 401
    assert (await c.get("/console/")).status_code == 401     # the sign-in form, no session
    refused = (await gw.admin.get("/audit", params={"action": "console.sign_in_refused"})).json()["data"]
    assert {e["detail"]["reason"] for e in refused} >= {"not_an_admin_key", "invalid"}
    assert tenant_key not in (await gw.admin.get("/audit", params={"limit": 1000})).text


async def test_sign_in_is_rate_limited_per_client(gw):
    from lockgate.gateway.console.signin import SignInLimit

    limit = SignInLimit(3)
    assert [limit.admit("a", now=t) for t in (0, 1, 2)] == [0, 0, 0]
    assert limit.admit("a", now=3) == pytest.approx(57)
    assert limit.admit("b", now=3) == 0
    assert limit.admit("a", now=61) == 0


async def test_a_post_without_the_csrf_token_is_403(gw):
    c = await sign_in(gw, gw.admin_key)
    page = await c.get("/console/tenants")
    token = csrf(page)
    name = "csrf-" + secrets.token_hex(3)
    for data in ({"name": name}, {"name": name, "csrf": "0" * 64}):
        r = await c.post("/console/tenants", data=data)
        assert r.status_code == 403, r.text
        assert "CSRF" in r.text
    assert (await gw.admin.get("/tenants", params={"name": name})).json()["data"] == []
    r = await c.post("/console/tenants", data={"name": name, "csrf": token})
    assert r.status_code == 303
    # the sign-in form's own token too
    fresh = gw.client()
    await fresh.get("/console/sign-in")
    assert (await fresh.post("/console/sign-in", data={"key": gw.admin_key})).status_code == 403


async def test_every_console_answer_sends_the_csp(gw):
    c = await sign_in(gw, gw.admin_key)
    for path in ("/console/", "/console/sign-in", "/console/static/console.css", "/console/static/console.js",
                 "/console/engine/live", "/console/nothing-here", "/console/tenants/ten_nope"):
        r = await c.get(path)
        csp = r.headers.get("content-security-policy", "")
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, (path, r.status_code, csp)
    assert "content-security-policy" not in (await gw.http.get("/health")).headers


async def test_a_key_name_renders_as_text(gw):
    c = await sign_in(gw, gw.admin_key)
    t, _ = await gw.tenant()
    evil = "<script>alert(1)</script>"
    assert (await gw.admin.post(f"/tenants/{t['id']}/keys", json={"name": evil})).status_code == 201
    page = await c.get(f"/console/tenants/{t['id']}")
    assert page.status_code == 200
    assert evil not in page.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text


async def test_a_revoked_key_ends_its_sessions(gw):
    key_id, key = await admin_key(gw, name="short-lived")
    c = await sign_in(gw, key)
    assert (await c.get("/console/keys")).status_code == 200
    assert (await gw.admin.delete(f"/keys/{key_id}")).status_code == 200
    r = await c.get("/console/keys")
    assert r.status_code == 401 and "Sign in" in r.text


async def test_sign_out_ends_the_session(gw):
    c = await sign_in(gw, gw.admin_key)
    page = await c.get("/console/")
    token = c.cookies.get("lockgate_console")
    r = await c.post("/console/sign-out", data={"csrf": csrf(page)})
    assert r.status_code == 303
    again = gw.client(cookies={"lockgate_console": token})
    assert (await again.get("/console/")).status_code == 401


async def test_the_tenant_key_secret_is_shown_once(gw):
    c = await sign_in(gw, gw.admin_key)
    t, _ = await gw.tenant()
    page = await c.get(f"/console/tenants/{t['id']}")
    r = await c.post(f"/console/tenants/{t['id']}/keys", data={"name": "shown-once", "csrf": csrf(page)})
    assert r.status_code == 201, r.text
    secret = re.search(r'id="new-secret"[^>]*>(lg-[^<]+)<', r.text).group(1)
    assert (await gw.http.get("/v1/models", headers=gw.auth(secret))).status_code == 200
    assert secret not in (await c.get(f"/console/tenants/{t['id']}")).text
    assert secret not in (await gw.admin.get("/audit", params={"limit": 1000})).text


async def test_usage_csv_is_the_apis(gw):
    c = await sign_in(gw, gw.admin_key)
    _, key = await gw.tenant()
    r = await gw.http.post("/v1/completions", headers=gw.auth(key), json={"model": "tiny", "prompt": "hi",
                                                                          "max_tokens": 2})
    assert r.status_code == 200, r.text
    for _ in range(100):             # the usage writer commits its rows in groups, soon
        if "default" in (await gw.admin.get("/usage", params={"group_by": "service_tier"})).text:
            break
        await asyncio.sleep(0.05)
    for group in ("tenant", "service_tier", "model,day"):
        mine = await c.get("/console/usage.csv", params={"group_by": group})
        api = await gw.admin.get("/usage", params={"group_by": group, "format": "csv"})
        assert mine.status_code == 200 and mine.text == api.text and mine.text.count("\n") >= 2, group
    page = await c.get("/console/usage", params={"group_by": "service_tier"})
    assert page.status_code == 200 and "<td>default</td>" in page.text


async def test_a_viewer_sees_every_page_and_changes_nothing(gw):
    _, key = await admin_key(gw, "viewer", name="auditor")
    c = await sign_in(gw, key)
    t, _ = await gw.tenant()
    for path in ("/console/", "/console/tenants", f"/console/tenants/{t['id']}", "/console/keys",
                 "/console/usage", "/console/engine", "/console/engine/live", "/console/audit"):
        r = await c.get(path)
        assert r.status_code == 200, (path, r.text[:500])
        # no form of a change is offered
        forms = re.findall(r'<form[^>]* method="post" action="([^"]+)"', r.text)
        assert forms == ([] if path.endswith("/live") else ["/console/sign-out"]), (path, forms)
    token = csrf(await c.get("/console/"))
    for path, data in (("/console/tenants", {"name": "viewer-made"}),
                       (f"/console/tenants/{t['id']}/delete", {}),
                       (f"/console/tenants/{t['id']}/keys", {"name": "k"}),
                       (f"/console/tenants/{t['id']}/quota", {"requests_per_minute": "1"}),
                       ("/console/keys", {"name": "k", "role": "admin"})):
        r = await c.post(path, data={**data, "csrf": token})
        assert r.status_code == 403, (path, r.text[:500])
    assert (await gw.admin.get(f"/tenants/{t['id']}")).json()["quota"]["requests_per_minute"] is None


async def test_a_bad_form_is_a_400_naming_the_field(gw):
    c = await sign_in(gw, gw.admin_key)
    t, _ = await gw.tenant()
    token = csrf(await c.get(f"/console/tenants/{t['id']}"))
    r = await c.post(f"/console/tenants/{t['id']}/quota", data={"requests_per_minute": "many", "csrf": token})
    assert r.status_code == 400 and "requests_per_minute" in r.text
    r = await c.post("/console/tenants", data={"name": "", "csrf": token})
    assert r.status_code == 400 and "name" in r.text


async def test_the_cookie_is_secure_over_https(gw):
    c = gw.client(base_url="https://test")
    form = await c.get("/console/sign-in")
    assert "Secure" in form.headers["set-cookie"]
    r = await c.post("/console/sign-in", data={"key": gw.admin_key, "csrf": csrf(form)})
    cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("lockgate_console="))
    assert "Secure" in cookie and "HttpOnly" in cookie


async def test_tenants_are_searched_by_name_a_page_at_a_time(gw):
    c = await sign_in(gw, gw.admin_key)
    tag = secrets.token_hex(3)
    made = [(await gw.tenant(f"Find-{tag}-{i}"))[0]["id"] for i in range(30)]
    await gw.tenant(f"other-{tag}")
    first = await c.get("/console/tenants", params={"q": f"find-{tag}"})
    ids = re.findall(r'<code>(ten_[0-9a-f]+)</code>', first.text)
    nxt = re.search(r'rel="next" href="([^"]+)"', first.text).group(1).replace("&amp;", "&")
    rest = re.findall(r'<code>(ten_[0-9a-f]+)</code>', (await c.get(nxt)).text)
    assert len(ids) == 25 and ids + rest == sorted(made)
    api = (await gw.admin.get("/tenants", params={"name": f"FIND-{tag}", "limit": 500})).json()["data"]
    assert sorted(t["id"] for t in api) == sorted(made)
    assert (await c.get("/console/tenants", params={"q": "%"})).status_code == 200
