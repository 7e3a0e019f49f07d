"""What PostgreSQL refuses mid-statement, refused first as a 400 naming the field, on both
backends (SQLite takes both, so a test on it alone passes either way): a NUL in anything that
names or identifies (query and path parameters, `model`, tenant, key and adapter fields) and an
integer past 64 bits (or negative where a count is meant). Free text keeps its NUL. A 500, should
one remain, says `Connection: close`, and the client's next request works."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import uvicorn

from lockgate.gateway.admin import tenants as tenant_routes
from lockgate.gateway.usage_api import encode_cursor
from lockgate.tenancy import api_keys, tenants
from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.quota import Quota
from lockgate.tenancy.validation import check_count
from tests.support.gateway_server import free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUL = "a\u0000b"
BIG = 2**63          # one past PostgreSQL's bigint
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["param"] == param, r.text[:300]


@pytest.mark.parametrize("path, param", [
    ("/v1/files?purpose=a%00b", "purpose"),
    ("/v1/files?after=a%00b", "after"),
    ("/v1/batches?after=a%00b", "after"),
    ("/v1/usage?group_by=a%00b", "group_by"),
    ("/v1/usage?after=a%00b", "after"),
    ("/v1/usage?group_by=model&after=" + encode_cursor(["tiny\u0000"]), "after"),   # NUL inside the cursor
])
async def test_nul_in_a_tenant_query_parameter_is_a_400(gateway, tenant, path, param):
    assert_400(await gateway.http.get(path, headers=gateway.auth(tenant[1])), param)


@pytest.mark.parametrize("path, param", [
    ("/tenants?after=a%00b", "after"),
    ("/audit?actor=a%00b", "actor"),
    ("/audit?target_id=a%00b", "target_id"),
    ("/usage?tenant_id=a%00b", "tenant_id"),
    ("/quotas/report?tenant_id=a%00b", "tenant_id"),
    ("/files?tenant_id=a%00b", "tenant_id"),
    ("/batches?after=a%00b", "after"),
])
async def test_nul_in_an_admin_query_parameter_is_a_400(gateway, path, param):
    assert_400(await gateway.admin.get(path), param)


@pytest.mark.parametrize("method, path, param", [
    ("GET", "/admin/v1/tenants/a%00b", "tenant_id"),
    ("GET", "/admin/v1/tenants/a%00b/keys", "tenant_id"),
    ("DELETE", "/admin/v1/tenants/a%00b", "tenant_id"),
    ("GET", "/admin/v1/keys/a%00b", "key_id"),
    ("DELETE", "/admin/v1/keys/a%00b", "key_id"),
    ("GET", "/admin/v1/adapters/a%00b", "adapter_id"),
    ("POST", "/admin/v1/batches/a%00b/cancel", "batch_id"),
])
async def test_nul_in_an_admin_path_id_is_a_400(gateway, method, path, param):
    r = await gateway.http.request(method, path, headers=gateway.auth(gateway.admin_key))
    assert_400(r, param)


@pytest.mark.parametrize("path, param", [
    ("/v1/files/a%00b", "file_id"),
    ("/v1/batches/a%00b", "batch_id"),
    ("/v1/models/a%00b", "model_id"),
])
async def test_nul_in_a_tenant_path_id_is_a_400(gateway, tenant, path, param):
    assert_400(await gateway.http.get(path, headers=gateway.auth(tenant[1])), param)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1]}),
])
async def test_nul_in_model_is_a_400(gateway, tenant, path, body):
    r = await gateway.http.post(path, headers=gateway.auth(tenant[1]), json={"model": NUL, **body})
    assert_400(r, "model")


@pytest.mark.parametrize("path, body, param", [
    ("/tenants", {"name": NUL}, "name"),
    ("/tenants", {"name": "ok-name", "models": ["tiny", NUL]}, "models[1]"),
    ("/keys", {"name": NUL}, "name"),
    ("/adapters", {"name": NUL, "base_model": "tiny", "path": "x"}, "name"),
    ("/adapters", {"name": "ad", "base_model": NUL, "path": "x"}, "base_model"),
    ("/adapters", {"name": "ad", "base_model": "tiny", "path": NUL}, "path"),
    ("/adapters", {"name": "ad", "base_model": "tiny", "path": "x", "owner_tenant_id": NUL},
     "owner_tenant_id"),
])
async def test_nul_in_an_admin_field_is_a_400(gateway, path, body, param):
    assert_400(await gateway.admin.post(path, json=body), param)


async def test_nul_in_a_batch_input_file_id_is_a_400(gateway, tenant):
    body = {"input_file_id": NUL, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = await gateway.http.post("/v1/batches", headers=gateway.auth(tenant[1]), json=body)
    assert_400(r, "input_file_id")


async def test_nul_in_tenant_and_key_changes_is_a_400(gateway, tenant):
    t = tenant[0]
    assert_400(await gateway.admin.patch(f"/tenants/{t['id']}", json={"name": NUL}), "name")
    assert_400(await gateway.admin.patch(f"/tenants/{t['id']}", json={"models": [NUL]}), "models[0]")
    assert_400(await gateway.admin.post(f"/tenants/{t['id']}/keys", json={"name": NUL}), "name")
    for path, body in (("/v1/load_lora_adapter", {"lora_name": NUL, "lora_path": "x"}),
                       ("/v1/unload_lora_adapter", {"lora_name": NUL})):
        r = await gateway.http.post(path, headers=gateway.auth(gateway.admin_key), json=body)
        assert_400(r, "lora_name")


@pytest.mark.parametrize("field", ["daily_token_budget", "monthly_token_budget", "requests_per_minute",
                                   "tokens_per_minute", "max_concurrent_requests"])
async def test_a_quota_past_64_bits_or_negative_is_a_400(gateway, tenant, field):
    t = tenant[0]
    for value in (BIG, -1):
        assert_400(await gateway.admin.put(f"/tenants/{t['id']}/quota", json={field: value}), field)
        r = await gateway.admin.post(f"/tenants/{t['id']}/keys", json={"name": "k", "quota": {field: value}})
        assert_400(r, f"quota.{field}")
    r = await gateway.admin.put(f"/tenants/{t['id']}/quota", json={field: BIG - 1})
    assert r.status_code == 200 and r.json()["quota"][field] == BIG - 1, r.text[:300]
    r = await gateway.admin.put(f"/tenants/{t['id']}/quota", json={})
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", "seed", "top_k", "min_tokens", "n"])
async def test_an_integer_past_64_bits_in_a_request_is_a_400(gateway, tenant, field):
    body = {"model": "tiny", **CHAT, field: BIG}
    r = await gateway.http.post("/v1/chat/completions", headers=gateway.auth(tenant[1]), json=body)
    assert_400(r, field)


@pytest.mark.parametrize("when", ["9999-12-31T23:59:59-23:00", "0001-01-01T00:00:00+01:00"])
async def test_an_expiry_out_of_range_in_utc_is_a_400(gateway, tenant, when):
    assert_400(await gateway.admin.post("/keys", json={"name": "k", "expires_at": when}), "expires_at")
    r = await gateway.admin.post(f"/tenants/{tenant[0]['id']}/keys", json={"name": "k", "expires_at": when})
    assert_400(r, "expires_at")


@pytest.mark.parametrize("path, param", [
    ("/admin/v1/tenants?limit=9223372036854775808", "limit"),
    ("/admin/v1/files?limit=9223372036854775808", "limit"),
    ("/admin/v1/audit?after=9223372036854775808", "after"),
    ("/admin/v1/audit?limit=-1", "limit"),
])
async def test_a_query_integer_past_64_bits_is_a_400(gateway, path, param):
    assert_400(await gateway.http.get(path, headers=gateway.auth(gateway.admin_key)), param)


async def test_nul_in_free_text_is_accepted(gateway, tenant):
    """Prompts are text a tokenizer takes as it is; nothing stores them in a text column."""
    body = {"model": "tiny", "max_tokens": 1, "stop": ["x\u0000"], "user": NUL,
            "messages": [{"role": "system", "content": NUL}, {"role": "user", "content": NUL}]}
    r = await gateway.http.post("/v1/chat/completions", headers=gateway.auth(tenant[1]), json=body)
    assert r.status_code == 200, r.text[:300]
    r = await gateway.http.post("/v1/completions", headers=gateway.auth(tenant[1]),
                                json={"model": "tiny", "prompt": NUL, "max_tokens": 1})
    assert r.status_code == 200, r.text[:300]
    r = await gateway.http.post("/tokenize", headers=gateway.auth(tenant[1]), json={"model": "tiny", "prompt": NUL})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text[:300]


async def _broken(*args, **kwargs):
    raise RuntimeError("a bug standing in for any unexpected error")


async def test_a_500_says_connection_close_and_the_next_request_works(gateway, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(tenant_routes.tenants, "get_tenant", _broken)
        r = await gateway.admin.get("/tenants/some-id")
        assert r.status_code == 500, r.text[:300]
        assert r.headers.get("connection") == "close", dict(r.headers)
        assert r.json()["error"]["code"] == "internal_error"
    r = await gateway.admin.get("/tenants")
    assert r.status_code == 200, r.text[:300]


async def test_after_a_500_on_the_wire_the_client_reconnects_and_its_next_request_works(gateway, monkeypatch):
    """uvicorn on a loopback port, serving this module's app: the 500's `Connection: close`
    makes the client drop the connection the server is closing, and open a fresh one."""
    server = uvicorn.Server(uvicorn.Config(gateway.app, host="127.0.0.1", port=free_port(),
                                           lifespan="off", log_level="critical"))
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(30):
            while not server.started:
                await asyncio.sleep(0.02)
        connects: list[str] = []

        async def trace(event: str, info: dict) -> None:
            if event == "connection.connect_tcp.complete":
                connects.append(event)

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.config.port}/admin/v1", timeout=30,
                                     headers=gateway.auth(gateway.admin_key)) as c:
            assert (await c.get("/tenants", extensions={"trace": trace})).status_code == 200
            with monkeypatch.context() as m:
                m.setattr(tenant_routes.tenants, "get_tenant", _broken)
                r = await c.get("/tenants/some-id", extensions={"trace": trace})
            assert r.status_code == 500 and r.headers.get("connection") == "close", (r.status_code, dict(r.headers))
            for _ in range(3):
                assert (await c.get("/tenants", extensions={"trace": trace})).status_code == 200
        assert server.server_state.total_requests == 5
        assert len(connects) == 2          # one before the 500 (kept alive), one fresh after it
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def test_tenancy_refuses_nul_and_bigint_overflow_itself(gateway, tenant):
    """The same checks one level down, for callers that are not routes (the command line)."""
    t = tenant[0]
    async with gateway.app.state.lockgate.sessions() as s:
        for call, field in ((tenants.get_tenant(s, NUL), "tenant_id"), (api_keys.get_key(s, NUL), "key_id"),
                            (tenants.list_tenants(s, after=NUL), "after"),
                            (tenants.update_tenant(s, t["id"], actor="test", models=[NUL]), "models"),
                            (api_keys.create_key(s, tenant_id=t["id"], name="k", pepper=b"p" * 32, actor="test",
                                                 scopes=("inference", NUL)), "scopes")):
            with pytest.raises(Invalid) as exc:
                await call
            assert exc.value.field == field, exc.value
        with pytest.raises(Invalid) as exc:
            await tenants.set_quota(s, t["id"], {"daily_token_budget": BIG}, actor="test")
        assert exc.value.field == "quota" and "daily_token_budget" in str(exc.value), exc.value
    with pytest.raises(ValueError, match="daily_token_budget"):
        Quota(daily_token_budget=BIG)
    assert check_count(BIG - 1, "n") == BIG - 1
    with pytest.raises(Invalid):
        check_count(BIG, "n")
