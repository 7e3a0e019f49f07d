"""The console's one table of page x action x role (gateway/console/actions.py), walked route by
route: each action done through the console and through the /admin/v1 route it stands for,
with an admin key and with a viewer key; both refuse (403) exactly what the table refuses and
allow the rest. Every console route but signing in and out is in the table."""

from __future__ import annotations

import secrets

import pytest
import pytest_asyncio

from lockgate.gateway.console.actions import ACTIONS, table
from tests.gateway.test_console import admin_key, csrf, sign_in
from tests.gateway.test_gateway_security import _flatten
from tests.support.inprocess_gateway import InProcessGateway, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

# the table as it stands: a change to who may do what changes this line too
EXPECTED = {
    ("overview", "view"): (True, True), ("tenants", "view"): (True, True), ("tenants", "create"): (True, False),
    ("tenant", "view"): (True, True), ("tenant", "edit_quota"): (True, False), ("tenant", "delete"): (True, False),
    ("tenant", "create_key"): (True, False), ("keys", "view"): (True, True), ("keys", "create"): (True, False),
    ("keys", "revoke"): (True, False), ("usage", "view"): (True, True), ("usage", "download"): (True, True),
    ("engine", "view"): (True, True), ("engine", "refresh"): (True, True), ("audit", "view"): (True, True),
    ("models", "view"): (True, True), ("models", "register_adapter"): (True, False),
    ("models", "unload_adapter"): (True, False), ("quotas", "view"): (True, True),
}
# the fake engine reads no adapter files: an allowed registration is the engine's 400 (after
# authorization); a real one through the console: tests/gateway/test_gateway_adapters.py
ENGINE_REFUSES = {("models", "register_adapter")}
API_BODIES = {("tenants", "create"): lambda: {"name": "api-" + secrets.token_hex(4)},
              ("tenant", "edit_quota"): lambda: {"requests_per_minute": 5},
              ("tenant", "create_key"): lambda: {"name": "api-key"},
              ("keys", "create"): lambda: {"name": "api-admin", "scopes": ["viewer"]},
              ("models", "register_adapter"): lambda: {"name": "api-ada", "base_model": "tiny", "path": "x"}}
FORMS = {("tenants", "create"): lambda: {"name": "console-" + secrets.token_hex(4)},
         ("tenant", "edit_quota"): lambda: {"requests_per_minute": "5"},
         ("tenant", "create_key"): lambda: {"name": "console-key"},
         ("keys", "create"): lambda: {"name": "console-admin", "role": "viewer"},
         ("models", "register_adapter"): lambda: {"name": "console-ada", "base_model": "tiny", "path": "x"}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory) -> InProcessGateway:
    async with running_gateway(tmp_path_factory.mktemp("roles"), "embedded", engine="fake",
                               console_sign_ins_per_minute=1000) as g:
        yield g


async def test_the_table_is_as_documented():
    assert {(p, a): (roles["admin"], roles["viewer"]) for p, a, _, roles in table()} == EXPECTED


async def test_every_console_route_is_in_the_table(tmp_path):
    from lockgate.gateway.app import create_app
    from lockgate.gateway.settings import Settings

    app = create_app(Settings(data_dir=tmp_path))
    served = {(m, p) for p, methods, _ in _flatten(app.routes) for m in methods
              if p.startswith("/console") and m != "HEAD"}
    outside = {("GET", "/console"), ("GET", "/console/sign-in"), ("POST", "/console/sign-in"),
               ("POST", "/console/sign-out")}
    assert served - outside == {(a.console, a.console_path) for a in ACTIONS}


async def _targets(gw: InProcessGateway) -> dict[str, str]:
    """A fresh tenant, key and adapter row for each call that may delete or revoke them."""
    from tests.gateway.test_console_pages import adapter_row

    t, _ = await gw.tenant()
    keys = (await gw.admin.get(f"/tenants/{t['id']}/keys")).json()["data"]
    return {"tenant_id": t["id"], "key_id": keys[0]["id"],
            "adapter_id": await adapter_row(gw, "ada-" + secrets.token_hex(4))}


@pytest.mark.parametrize("role", ["viewer", "admin"])
async def test_the_console_and_the_api_agree_action_by_action(gw, role):
    _, key = await admin_key(gw, role, name=f"roles-{role}")
    console = await sign_in(gw, key)
    api = gw.client(key)
    token = csrf(await console.get("/console/"))
    for a in ACTIONS:
        allowed = EXPECTED[(a.page, a.action)][role == "viewer"]
        ids = await _targets(gw)
        body = API_BODIES.get((a.page, a.action), dict)() if a.method in ("POST", "PUT") else None
        ok = (400, 401) if (a.page, a.action) in ENGINE_REFUSES else (200, 300)
        r = await api.request(a.method, a.api.format(**ids), json=body)
        what = f"{role} {a.method} {a.api} -> {r.status_code} {r.text[:200]}"
        assert ok[0] <= r.status_code < ok[1] if allowed else r.status_code == 403, what
        ids = await _targets(gw)
        if a.console == "POST":
            r = await console.post(a.console_path.format(**ids),
                                   data={**FORMS.get((a.page, a.action), dict)(), "csrf": token})
        else:
            r = await console.get(a.console_path.format(**ids))
        what = f"{role} console {a.console} {a.console_path} -> {r.status_code} {r.text[:300]}"
        ok = (400, 401) if (a.page, a.action) in ENGINE_REFUSES else (200, 400)
        assert ok[0] <= r.status_code < ok[1] if allowed else r.status_code == 403, what


async def test_a_viewer_key_reads_every_admin_route_and_changes_none(gw, tmp_path):
    """Every admin route of the app: GET answers a viewer key as it answers an admin key
    (never 401/403); every other method is 403 `read_only_key`, before its body is read."""
    from lockgate.gateway.app import create_app
    from lockgate.gateway.settings import Settings
    from tests.gateway.test_gateway_security import fill, is_admin_route

    _, key = await admin_key(gw, "viewer", name="walker")
    viewer = gw.client(key)
    ids = await _targets(gw)
    values = {**ids, "adapter_id": "ada_0000000000000000", "batch_id": "batch_0000"}
    before = (await gw.admin.get(f"/tenants/{ids['tenant_id']}")).json()
    routes = [(p, m) for p, methods, _ in _flatten(create_app(Settings(data_dir=tmp_path)).routes)
              if is_admin_route(p) for m in sorted(methods) if m != "HEAD"]
    assert len(routes) >= 25, routes
    for path, method in routes:
        r = await viewer.request(method, fill(path, values), json={"name": 7} if method != "GET" else None)
        what = f"{method} {path} -> {r.status_code} {r.text[:200]}"
        if method == "GET":
            assert r.status_code not in (401, 403) and r.status_code < 500, what
        else:
            assert r.status_code == 403 and r.json()["error"]["code"] == "read_only_key", what
    assert (await gw.admin.get(f"/tenants/{ids['tenant_id']}")).json() == before
    assert (await gw.admin.get(f"/keys/{ids['key_id']}")).json()["revoked_at"] is None


async def test_a_viewer_key_is_made_through_the_api_and_is_no_tenant_key(gw):
    r = await gw.admin.post("/keys", json={"name": "v", "scopes": ["viewer"]})
    assert r.status_code == 201 and r.json()["scopes"] == ["viewer"] and r.json()["tenant_id"] is None
    for scopes in (["viewer", "admin"], ["inference"], []):
        assert (await gw.admin.post("/keys", json={"name": "v", "scopes": scopes})).status_code == 400, scopes
    t, _ = await gw.tenant()
    r = await gw.admin.post(f"/tenants/{t['id']}/keys", json={"name": "v", "scopes": ["viewer"]})
    assert r.status_code == 400, r.text
    assert (await gw.http.get("/v1/models", headers=gw.auth(r.json().get("key", "lg-x" * 8)))).status_code == 401
    listed = (await gw.admin.get("/keys")).json()["data"]
    assert {"admin", "viewer"} <= {s for k in listed for s in k["scopes"]}
    assert all(k["tenant_id"] is None for k in listed)
