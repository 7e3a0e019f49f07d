"""The admin console in a real browser: Debian's chromium, headless, driven by Playwright,
against a live `lockgate serve --root-path /ops` on PostgreSQL and Redis (one server for the
module). Signing in (a tenant key refused), a tenant made and given a key (its secret shown
once: gone on the next visit and absent from the audit log), the key revoked and the next API
call with it refused, the engine's fragment refreshed by polling, a viewer seeing every page
and refused every change, the usage CSV the browser downloads equal to the API's, and every URL
the browser asked for under /ops/, none answered >= 400 on a walk of every page."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_server import running_server

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = Path("/usr/bin/chromium")
ROOT = "/ops"
PAGES = ("Overview", "Tenants", "Keys", "Usage", "Models", "Quotas", "Engine", "Audit log")
# LOCKGATE_SCREENSHOTS=1: a PNG of every page into docs/console/ (docs/console.md shows them)
SHOTS = (Path(__file__).resolve().parents[2] / "docs" / "console"
         if os.environ.get("LOCKGATE_SCREENSHOTS") == "1" else None)
FLOOD = 40                  # flex streams of one tenant, beside an engine that runs 2 at once
FLOOD_KWARGS = {"kv_cache_memory": 32 << 20, "max_num_seqs": 2}

if not CHROMIUM.exists():
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI: /usr/bin/chromium is missing; scripts/setup.sh installs it (apt: chromium)")
    pytest.skip("Debian's chromium is not installed (scripts/setup.sh installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("console-browser"), "services", extra_args=["--root-path", ROOT],
                        extra_env={"LOCKGATE_ENGINE_KWARGS": json.dumps(FLOOD_KWARGS),
                                   "LOCKGATE_REFUSAL_FLUSH_INTERVAL_S": "0.2"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


class Session:
    """A browser context of its own, every request and answer it saw recorded."""

    def __init__(self, browser, server) -> None:
        self.server = server
        self.context = browser.new_context(base_url=server.url, viewport={"width": 1280, "height": 800})
        self.context.set_default_timeout(10_000)
        self.requests: list[str] = []
        self.answers: list[tuple[int, str]] = []
        self.context.on("request", lambda r: self.requests.append(r.url))
        self.context.on("response", lambda r: self.answers.append((r.status, r.url)))
        self.page = self.context.new_page()

    def sign_in(self, key: str) -> None:
        self.page.goto(f"{ROOT}/console/sign-in")
        self.page.fill("input[name=key]", key)
        self.page.click("button[type=submit]")

    def nav(self, label: str) -> None:
        self.page.click(f"header nav >> text={label}")
        self.page.wait_for_load_state()

    def shot(self, name: str) -> None:
        """The page as a PNG in docs/console/ when LOCKGATE_SCREENSHOTS=1 (the viewport only)."""
        if SHOTS is not None:
            SHOTS.mkdir(parents=True, exist_ok=True)
            path = SHOTS / f"{name}.png"
            self.page.screenshot(path=str(path))
            with contextlib.suppress(ImportError):        # a palette keeps the committed PNGs small
                from PIL import Image

                Image.open(path).quantize(colors=64).save(path, optimize=True)

    def paths(self) -> list[str]:
        return [httpx.URL(u).path for u in self.requests]

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def session(browser, server):
    s = Session(browser, server)
    yield s
    # every URL the browser asked for, the page's own links, forms, script and CSS alike
    outside = [u for u in s.requests if not u.startswith(f"{server.url}{ROOT}/")]
    assert s.requests and not outside, outside
    s.close()


def test_sign_in_with_an_admin_key_a_tenant_key_refused(session, server):
    _, tenant_key = server.tenant()
    session.page.goto(f"{ROOT}/console/sign-in")
    session.shot("sign-in")
    session.sign_in(tenant_key)
    assert "tenant's key" in session.page.inner_text("[role=alert]")
    assert session.page.locator("input[name=key]").count() == 1
    session.sign_in(server.admin_key)
    session.page.wait_for_url(f"**{ROOT}/console/")
    assert session.page.inner_text("h1") == "Overview"


def test_a_tenant_gets_a_key_shown_once_then_revoked(session, server):
    session.sign_in(server.admin_key)
    session.nav("Tenants")
    name = "acme-" + secrets.token_hex(3)
    session.page.fill("input[name=name]", name)
    session.page.click("text=Create tenant")
    assert session.page.inner_text("h1") == f"Tenant {name}"
    tenant_url = session.page.url
    session.page.fill("input[name=name]", "<script>alert(1)</script>")
    session.page.click("text=Create key")
    secret = session.page.inner_text("#new-secret")
    assert re.fullmatch(r"lg-\S{20,}", secret)
    assert session.page.locator("button[data-copy=new-secret]").count() == 1
    assert "<script>alert(1)</script>" in session.page.inner_text("td.key-name >> nth=-1")   # as text
    call = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert call.status_code == 200, call.text
    session.page.goto(tenant_url)
    assert secret not in session.page.content()
    assert secret not in server.admin.get("/audit", params={"limit": 1000}).text
    key_id = server.admin.get("/audit", params={"action": "key.create", "limit": 1}).json()["data"][0]["target_id"]
    session.page.click(f"button[data-revoke={key_id}]")
    session.page.wait_for_load_state()
    assert "revoked" in session.page.inner_text(f"tr:has(code:text('{key_id}'))")
    call = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=10)
    assert call.status_code == 401 and call.json()["error"]["code"] == "revoked", call.text


def _flood(server, key: str, n: int, done: list[int]) -> list[threading.Thread]:
    """`n` flex streams of one tenant on loopback, each read to its end in a thread of its own."""
    def one() -> None:
        body = {"model": "tiny", "prompt": "flood", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "service_tier": "flex"}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            for _ in r.iter_bytes():
                pass
            done.append(r.status_code)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_the_live_engine_page_follows_a_flex_flood_without_a_reload(session, server):
    """The engine page, polled once per refresh, shows the flooding tenant's queued flex
    requests and their numbers changing while the document stays the one first loaded."""
    t, key = server.tenant(service_tiers=["default", "flex"])
    session.sign_in(server.admin_key)
    session.nav("Engine")
    session.page.evaluate("() => { window.__stayed = true; document.body.dataset.loaded = 'once'; }")
    done: list[int] = []
    threads = _flood(server, key, FLOOD, done)
    try:
        row = f"#engine-live tr[data-tenant='{t['id']}'][data-tier='flex']"
        session.page.wait_for_function(
            f"() => {{ const r = document.querySelector(\"{row} td.waiting\"); return r && +r.textContent > 0; }}",
            timeout=20_000)
        session.shot("engine")
        before = session.page.inner_text(row)
        session.page.wait_for_function(
            "([sel, was]) => { const r = document.querySelector(sel); return r && r.innerText !== was; }",
            arg=[row, before], timeout=20_000)
        assert session.page.evaluate("window.__stayed") is True          # the same document, never reloaded
        assert session.page.get_attribute("body", "data-loaded") == "once"
        assert session.page.evaluate("performance.getEntriesByType('navigation').length") == 1
        refreshes = session.page.evaluate("() => +document.getElementById('engine-live').dataset.count")
        polls = session.paths().count(f"{ROOT}/console/engine/live")
        assert refreshes >= 2 and polls in (refreshes, refreshes + 1), (refreshes, polls)   # one request each
    finally:
        for th in threads:
            th.join(timeout=120)
    # the engine's bounded queue refuses the flood's excess (429), which the page counts as refused
    assert len(done) == FLOOD and set(done) <= {200, 429} and done.count(200) >= 10, done


def test_a_viewer_sees_every_page_and_every_change_is_refused(session, server):
    key = server.admin.post("/keys", json={"name": "auditor", "scopes": ["viewer"]}).json()["key"]
    t, _ = server.tenant()
    session.sign_in(key)
    for label in PAGES:
        session.nav(label)
        assert session.page.locator("form[method=post]").count() == 1, label     # sign-out alone
    session.page.goto(f"{ROOT}/console/tenants/{t['id']}")
    assert session.page.locator("form[method=post]").count() == 1
    csrf = session.page.get_attribute("input[name=csrf]", "value")
    for path, form in ((f"/console/tenants/{t['id']}/delete", {}), ("/console/tenants", {"name": "viewer-made"}),
                       (f"/console/tenants/{t['id']}/keys", {"name": "k"}), ("/console/keys", {"name": "k"})):
        status = session.page.evaluate(
            "([url, form]) => fetch(url, {method: 'POST', body: new URLSearchParams(form)}).then(r => r.status)",
            [ROOT + path, {**form, "csrf": csrf}])
        assert status == 403, path
    assert server.admin.get(f"/tenants/{t['id']}").status_code == 200


def _refused_once(server) -> None:
    """A tenant's second request in a minute refused by its limit (a `priority` request: the
    overview counts its refusal in that tier), waited for in the quota report."""
    t, key = server.tenant(quota={"requests_per_minute": 1}, service_tiers=["default", "priority"])
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "service_tier": "priority"}
    codes = [httpx.post(server.url + ROOT + "/v1/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {key}"}).status_code for _ in range(2)]
    assert codes == [200, 429], codes
    for _ in range(100):
        report = server.admin.get("/quotas/report", params={"tenant_id": t["id"]}).json()
        if report["data"][0]["limits"]["requests_per_minute"]["refused"] == 1:
            return
        time.sleep(0.1)
    raise AssertionError(report)


def test_every_page_under_the_root_path_answers(session, server):
    _refused_once(server)
    session.sign_in(server.admin_key)
    session.page.wait_for_url(f"**{ROOT}/console/")
    refusals = session.page.inner_text("tr[data-tier=priority] >> td >> nth=4")
    assert int(refusals) >= 1, session.page.inner_text("table")
    assert session.page.locator("svg.chart").count() == 6
    for label in PAGES:
        session.nav(label)
        if label != "Engine":                  # shot during a flood: test_the_live_engine_page_...
            session.shot(label.lower().replace(" log", ""))
    t, _ = server.tenant()
    session.page.goto(f"{ROOT}/console/tenants/{t['id']}")
    session.shot("tenant")
    session.page.fill("input[name=requests_per_minute]", "120")
    session.page.click("text=Save quota")
    assert session.page.input_value("input[name=requests_per_minute]") == "120"
    session.page.click("text=Sign out")
    session.page.wait_for_url(f"**{ROOT}/console/sign-in")
    bad = [(s, u) for s, u in session.answers if s >= 400]
    assert not bad, bad
    assert len(session.requests) >= 12 and any(p.endswith("/console.js") for p in session.paths())


def test_the_usage_csv_downloaded_in_the_browser_is_the_apis(session, server):
    t, key = server.tenant()
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    call = httpx.post(server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})
    assert call.status_code == 200, call.text
    for _ in range(100):                 # the usage writer commits its rows in groups, soon
        if t["id"] in server.admin.get("/usage", params={"group_by": "tenant", "format": "csv"}).text:
            break
        time.sleep(0.05)
    session.sign_in(server.admin_key)
    session.page.wait_for_url(f"**{ROOT}/console/")
    for group in ("tenant", "model,day"):
        session.page.goto(f"{ROOT}/console/usage?group_by={group}")
        with session.page.expect_download() as download:
            session.page.click("text=Download CSV")
        got = Path(download.value.path()).read_bytes().decode()      # as sent: CRLF rows
        api = server.admin.get("/usage", params={"group_by": group, "format": "csv"}).text
        assert got == api and got.count("\n") >= 2, (group, got[:300], api[:300])
