"""Security acceptance tests against the gateway in process, on both backends (SQLite + the
in-process limiter; PostgreSQL + Redis), with the fake served engine: tenant isolation,
admin-route authorization, no key material at rest or in logs, revocation (across replicas:
tests/gateway/test_gateway_replicas.py), key/tenant life cycle, and the admin API's
validation, pagination, audit and atomicity.

The route lists are enumerated from `create_app().routes`, so a route added later is covered
without editing this file (a new path parameter name makes the isolation test fail until it is
given a value below)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import secrets
import sqlite3
import stat
import time
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import httpx
import pytest
import pytest_asyncio
from pydantic import BaseModel

from lockgate.gateway.admin.vllm_lora import PATHS as VLLM_ADMIN_PATHS
from lockgate.tenancy import keys as keymod
from tests.support.helpers import demo_model
from tests.support.inprocess_gateway import InProcessGateway, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

MUTATING = ("POST", "PUT", "PATCH")
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::[A-Za-z_]+)?\}")


# -- the app's routes, enumerated ---------------------------------------------------------------
def _flatten(routes: Any) -> list[tuple[str, frozenset[str], Any]]:
    """(path, methods, body model or None) of every endpoint, through included routers (FastAPI
    >= 0.16x keeps them as `_IncludedRouter`s with `effective_candidates()`) and mounts."""
    out: list[tuple[str, frozenset[str], Any]] = []
    for r in routes:
        if hasattr(r, "effective_candidates"):
            out += _flatten(r.effective_candidates())
            continue
        original = getattr(r, "original_route", r)
        methods = getattr(r, "methods", None) or getattr(original, "methods", None)
        path = getattr(r, "path", None) or getattr(original, "path", None)
        if path and methods:
            bf = getattr(original, "body_field", None)
            model = bf.field_info.annotation if bf is not None else None
            out.append((path, frozenset(methods), model))
        elif hasattr(r, "routes"):                  # a Starlette Mount
            prefix = getattr(r, "path", "") or ""
            out += [(prefix + p, m, b) for p, m, b in _flatten(r.routes)]
    return out


@pytest.fixture(scope="module")
def app_routes(tmp_path_factory) -> list[tuple[str, frozenset[str], Any]]:
    from lockgate.gateway.app import create_app
    from lockgate.gateway.settings import Settings

    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("routes")))
    routes = _flatten(app.routes)
    assert routes, "no routes enumerated from create_app().routes"
    return routes


def is_admin_route(path: str) -> bool:
    """/admin routes, and vLLM's adapter routes under /v1 (admin keys only, as vLLM's)."""
    return path.startswith("/admin") or path in VLLM_ADMIN_PATHS


def fill(path: str, values: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        name = m.group(1)
        assert name in values, (f"{path}: no test value for the path parameter {{{name}}}; "
                                "give it one in this test")
        return values[name]
    return _PARAM.sub(sub, path)


def _sample(ann: Any) -> Any:
    origin, args = get_origin(ann), get_args(ann)
    if origin in (Union, types.UnionType):
        return next((_sample(a) for a in args if a is not type(None)), None)
    if origin is Literal:
        return args[0]
    if origin is list:
        return [_sample(args[0])] if args else []
    if ann is str:
        return "x" + secrets.token_hex(4)
    if ann is bool:
        return False
    if ann is int:
        return 1000
    if ann is float:
        return 2.0
    if ann is datetime:
        return (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return valid_body(ann)
    return None


def valid_body(model: Any) -> dict:
    """A body the route would accept (required fields, else the first settable field), so a
    route whose authorization were missing would answer 2xx and change something."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return {}
    body = {n: _sample(f.annotation) for n, f in model.model_fields.items() if f.is_required()}
    if not body:
        for n, f in model.model_fields.items():
            v = _sample(f.annotation)
            if v is not None:
                body[n] = v
                break
    return body


# -- the gateway ---------------------------------------------------------------------------------
class Ctx:
    """A gateway plus every key this module was handed (for the key-material test)."""

    def __init__(self, gw: InProcessGateway) -> None:
        self.gw = gw
        self.backend = gw.backend
        self.http = gw.http
        self.admin = gw.admin
        self.issued: list[str] = [gw.admin_key]
        self.probed: list[str] = []          # keys presented that were never valid

    async def tenant(self, name: str | None = None, **fields) -> tuple[dict, str]:
        t, key = await self.gw.tenant(name or "t-" + secrets.token_hex(5), **fields)
        self.issued.append(key)
        return t, key

    async def new_key(self, tenant_id: str, **body) -> dict:
        r = await self.admin.post(f"/tenants/{tenant_id}/keys", json={"name": "k", **body})
        assert r.status_code == 201, r.text
        self.issued.append(r.json()["key"])
        return r.json()

    async def call(self, method: str, path: str, key: str | None = None, *, header: str = "bearer",
                   **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            if header == "bearer":
                headers["Authorization"] = f"Bearer {key}"
            else:
                headers["x-api-key"] = key
        return await self.http.request(method, path, headers=headers, **kw)

    async def chat(self, key: str, model: str = "tiny", **kw) -> httpx.Response:
        return await self.call("POST", "/v1/chat/completions", key, json={
            "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}, **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["embedded", "services"])
async def ctx(request, tmp_path_factory):
    """The gateway, logging at INFO (as `lockgate -v serve`: SQLAlchemy's statements included)
    into `gw.log()`."""
    models = {"tiny": demo_model("llama", "tiny", 0), "b-private": demo_model("llama", "tiny", 1)}
    async with running_gateway(tmp_path_factory.mktemp(f"sec-{request.param}"), request.param,
                               models=models, private_models=("b-private",),
                               log_level=logging.INFO, log_loggers=("sqlalchemy.engine",)) as gw:
        yield Ctx(gw)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenants(ctx):
    """Tenant A (public models only) and tenant B (also the private model b-private)."""
    a, key_a = await ctx.tenant("iso-a-" + secrets.token_hex(4))
    b, key_b = await ctx.tenant("iso-b-" + secrets.token_hex(4), models=["tiny", "b-private"])
    return a, key_a, b, key_b


def err(r: httpx.Response) -> dict:
    return r.json().get("error") or {}


async def poll(fn, timeout: float = 5.0, every: float = 0.25) -> tuple[bool, float]:
    """Await `fn()` until it returns true or `timeout` passes: (succeeded, elapsed seconds)."""
    t0 = time.monotonic()
    while True:
        if await fn():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0
        await asyncio.sleep(every)


async def status_is(response, status: int) -> bool:
    """Whether the awaited response has this status."""
    return (await response).status_code == status


# -- direct database access -------------------------------------------------------------------
def _pg_conninfo(gw: InProcessGateway) -> str | None:
    url = gw.settings.database_url
    if not url:
        return None
    return re.sub(r"^postgresql\+\w+://", "postgresql://", url)


def db_query(gw: InProcessGateway, sql: str, params: tuple = ()) -> list[tuple]:
    """Run one SELECT on the gateway's database; `?` placeholders on both backends."""
    conninfo = _pg_conninfo(gw)
    if conninfo is None:
        con = sqlite3.connect(gw.data_dir / "lockgate.db", timeout=10)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as con:
        return con.execute(sql.replace("?", "%s"), params).fetchall()


def db_dump(gw: InProcessGateway) -> dict[str, list[tuple]]:
    """Every row of every table."""
    conninfo = _pg_conninfo(gw)
    if conninfo is None:
        tables = [r[0] for r in db_query(gw, "SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: db_query(gw, f'SELECT * FROM "{t}"') for t in tables}  # noqa: S608 - names from sqlite_master
    import psycopg
    from psycopg import sql

    out = {}
    with psycopg.connect(conninfo, autocommit=True) as con:
        tables = [r[0] for r in con.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_schema = 'public' AND table_type = 'BASE TABLE'").fetchall()]
        for t in tables:
            out[t] = con.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(t))).fetchall()
    return out


def key_fragments(key: str) -> list[str]:
    """The key itself and every 12-character window of its secret part (what follows the
    stored lookup prefix): any of them found at rest is a leak."""
    secret = key[len(keymod.KEY_PREFIX) + keymod.LOOKUP_PREFIX_LEN:]
    assert len(secret) >= 12, key
    return [key] + [secret[i:i + 12] for i in range(len(secret) - 11)]


def find_leaks(text: str, keys: list[str]) -> list[str]:
    return [f"{k[:15]}... ({frag!r})" for k in keys for frag in key_fragments(k) if frag in text]


# == 1. tenant isolation ==========================================================================
async def test_private_model_and_usage_isolation(ctx, tenants):
    a, key_a, b, key_b = tenants
    # B uses its private model on both endpoints and sees it
    r = await ctx.chat(key_b, "b-private")
    assert r.status_code == 200, r.text
    r = await ctx.call("POST", "/v1/completions", key_b,
                       json={"model": "b-private", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert (await ctx.chat(key_b, "tiny")).status_code == 200
    assert (await ctx.call("GET", "/v1/models/b-private", key_b)).json()["id"] == "b-private"
    listed = (await ctx.call("GET", "/v1/models", key_b)).json()["data"]
    assert {m["id"] for m in listed} == {"tiny", "b-private"}
    # A: the private model does not exist
    assert (await ctx.chat(key_a, "tiny")).status_code == 200
    for r in (await ctx.chat(key_a, "b-private"),
              await ctx.chat(key_a, "b-private", header="x-api-key"),
              await ctx.call("POST", "/v1/completions", key_a,
                             json={"model": "b-private", "prompt": "x", "max_tokens": 2}),
              await ctx.call("GET", "/v1/models/b-private", key_a)):
        assert r.status_code == 404, r.text
        assert err(r)["code"] == "model_not_found"
    ids = [m["id"] for m in (await ctx.call("GET", "/v1/models", key_a)).json()["data"]]
    assert ids == ["tiny"]

    # usage: B's rows exist (the admin sees 3) but A never gets them
    r = await ctx.admin.get("/usage", params={"tenant_id": b["id"]})
    assert r.status_code == 200 and r.json()["data"][0]["requests"] == 3, r.text
    r = await ctx.call("GET", "/v1/usage", key_a, params={"tenant_id": b["id"]})
    assert r.status_code == 403, r.text
    assert err(r)["code"] == "permission_denied" and "data" not in r.json()
    for params in ({}, {"tenant_id": a["id"]}, {"group_by": "model"},
                   [("tenant_id", a["id"]), ("tenant_id", b["id"])],
                   [("tenant_id", b["id"]), ("tenant_id", a["id"])]):
        r = await ctx.call("GET", "/v1/usage", key_a, params=params)
        if r.status_code == 403:
            continue
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tenant_id"] == a["id"] and b["id"] not in r.text
        assert sum(g["requests"] for g in body["data"]) == 1, (params, body)   # A's one request
        assert all(g["group"] in (None, "tiny") for g in body["data"]), body
    r = await ctx.call("GET", "/v1/usage", key_a, params={"format": "csv", "group_by": "model"})
    assert r.status_code == 200 and "b-private" not in r.text


async def test_path_parameter_routes_refuse_another_tenants_objects(ctx, tenants, app_routes):
    """Every route with a path parameter, called with A's key on B's tenant, key and model:
    never 2xx, never B's data, and B is unchanged afterwards."""
    _, key_a, b, key_b = tenants
    b_keys = (await ctx.admin.get(f"/tenants/{b['id']}/keys")).json()["data"]
    b_key = next(k for k in b_keys if key_b.startswith(keymod.KEY_PREFIX + k["prefix"]))
    # B's own file and batch (the Batch API): A's key must not reach them either
    line = json.dumps({"custom_id": "b-secret", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "b", "max_tokens": 1}})
    r = await ctx.call("POST", "/v1/files", key_b, data={"purpose": "batch"},
                       files={"file": ("b.jsonl", line.encode())})
    assert r.status_code == 200, r.text
    b_file = r.json()["id"]
    r = await ctx.call("POST", "/v1/batches", key_b, json={"input_file_id": b_file, "endpoint": "/v1/completions",
                                                           "completion_window": "24h"})
    assert r.status_code == 200, r.text
    b_batch = r.json()["id"]
    r = await ctx.call("POST", "/v1/responses", key_b, json={"model": "tiny", "input": "b-secret-input",
                                                             "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    b_response = r.json()["id"]         # a stored response (the Responses API)
    values = {"tenant_id": b["id"], "key_id": b_key["id"], "model_id": "b-private",
              "adapter_id": "ada_0000000000000000", "file_id": b_file, "batch_id": b_batch,
              "response_id": b_response}
    b_data = {b["name"], b["id"], b_key["id"], b_key["prefix"], key_b,
              demo_model("llama", "tiny", 1), b_file, b_batch, "b-secret", b_response}
    before = (await ctx.admin.get(f"/tenants/{b['id']}")).json()

    checked = []
    for path, methods, model in app_routes:
        if "{" not in path:
            continue
        url = fill(path, values)
        secret = {s for s in b_data if s not in url}     # an echo of the URL is no leak
        for method in sorted(methods):
            for header in ("bearer", "x-api-key"):
                kw = {"json": valid_body(model)} if method in MUTATING else {}
                r = await ctx.call(method, url, key_a, header=header, **kw)
                what = f"{method} {url} ({header}) -> {r.status_code} {r.text[:300]}"
                assert not 200 <= r.status_code < 300, what
                assert r.status_code in (401, 403, 404), what
                leaked = [s for s in secret if s in r.text]
                assert not leaked, f"{what}: B's data {leaked}"
            checked.append(f"{method} {path}")
    assert any(p.startswith("GET /v1/models/") for p in checked), checked
    assert sum("{tenant_id}" in p for p in checked) >= 4, checked

    # nothing of B's changed, its key still works
    assert (await ctx.admin.get(f"/tenants/{b['id']}")).json() == before
    after = (await ctx.admin.get(f"/tenants/{b['id']}/keys")).json()["data"]
    assert [(k["id"], k["revoked_at"]) for k in after] == [(k["id"], k["revoked_at"]) for k in b_keys]
    assert (await ctx.chat(key_b, "b-private")).status_code == 200
    assert (await ctx.call("GET", f"/v1/files/{b_file}", key_b)).status_code == 200
    assert (await ctx.call("GET", f"/v1/batches/{b_batch}", key_b)).json()["status"] != "cancelling"
    assert (await ctx.call("GET", f"/v1/responses/{b_response}", key_b)).status_code == 200


# == 2. admin routes need an admin key ================================================================
async def test_every_admin_route_needs_an_admin_key(ctx, tenants, app_routes):
    a, key_a, _, _ = tenants
    admin_routes = [(p, m, b) for p, m, b in app_routes if is_admin_route(p)]
    assert set(VLLM_ADMIN_PATHS) <= {p for p, _, _ in admin_routes}
    pairs = [(p, meth) for p, m, _ in admin_routes for meth in sorted(m)]
    assert len(pairs) >= 10, pairs
    assert {"POST", "GET", "PATCH", "PUT", "DELETE"} <= {m for _, m in pairs}
    a_key_id = (await ctx.admin.get(f"/tenants/{a['id']}/keys")).json()["data"][0]["id"]
    # a tenant's key aimed at its own tenant and key: the most plausible escalation
    values = {"tenant_id": a["id"], "key_id": a_key_id, "adapter_id": "ada_0000000000000000",
              "batch_id": "batch_0000"}
    bogus = "lg-" + secrets.token_urlsafe(32)
    ctx.probed.append(bogus)
    invalid_bodies = [{"bogus": 1, "name": 7}, [1, 2], "text"]
    before = (await ctx.admin.get(f"/tenants/{a['id']}")).json()
    for path, method in pairs:
        url = fill(path, values)
        bodies = invalid_bodies if method in MUTATING else [None]
        for body in bodies:
            kw = {"json": body} if body is not None else {}
            for key, header, status, code in (
                (None, "bearer", 401, "missing_api_key"),
                (bogus, "bearer", 401, "invalid_api_key"),
                (bogus, "x-api-key", 401, "invalid_api_key"),
                ("not-a-key", "bearer", 401, "invalid_api_key"),
                (key_a, "bearer", 403, "admin_only"),
                (key_a, "x-api-key", 403, "admin_only"),
            ):
                r = await ctx.call(method, url, key, header=header, **kw)
                what = (f"{method} {url} key={key and key[:8]} body={body!r}: "
                        f"{r.status_code} {r.text[:200]}")
                assert r.status_code == status, what
                assert err(r)["code"] == code, what
    # an Authorization header without a usable bearer key: 401, whatever else is sent
    for value in ("Bearer", f"Basic {ctx.gw.admin_key}", f"Token {ctx.gw.admin_key}"):
        r = await ctx.call("GET", "/admin/v1/tenants", headers={"Authorization": value,
                                                                "x-api-key": ctx.gw.admin_key})
        assert r.status_code == 401, (value[:8], r.text)
    # nothing changed for A, and A's key still works
    assert (await ctx.admin.get(f"/tenants/{a['id']}")).json() == before
    assert (await ctx.chat(key_a)).status_code == 200


async def test_admin_key_cannot_call_tenant_routes(ctx, app_routes):
    v1 = [(p, m, b) for p, m, b in app_routes if p.startswith("/v1/") and not is_admin_route(p)]
    assert {p for p, _, _ in v1} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    for path, methods, _ in v1:
        url = fill(path, {"model_id": "tiny", "file_id": "file-0000", "batch_id": "batch_0000",
                          "response_id": "resp_0000"})
        for method in sorted(methods):
            kw = {"json": {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                           "prompt": "x", "max_tokens": 1}} if method in MUTATING else {}
            for header in ("bearer", "x-api-key"):
                r = await ctx.call(method, url, ctx.gw.admin_key, header=header, **kw)
                assert r.status_code == 403, f"{method} {url}: {r.status_code} {r.text}"
                if path.startswith("/v1/messages"):     # Anthropic's shape: a type, no code
                    assert err(r)["type"] == "permission_error" and "Admin keys" in err(r)["message"]
                else:
                    assert err(r)["code"] == "admin_key_not_allowed"


async def test_admin_auth_precedes_malformed_json(ctx, app_routes):
    """Admin routes authenticate before reading the body (gateway.admin.AdminRoute)."""
    posts = [p for p, m, _ in app_routes if is_admin_route(p) and "POST" in m]
    for path in posts:
        r = await ctx.call("POST", fill(path, {"tenant_id": "x", "adapter_id": "x", "batch_id": "x"}),
                           content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 401, f"POST {path}: {r.status_code} {r.text}"


# == 6. the admin API ==============================================================================
async def test_admin_tenant_validation_and_conflicts(ctx):
    admin = ctx.admin
    name = "adm-" + secrets.token_hex(4)
    r = await admin.post("/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["id"] and t["object"] == "tenant" and t["name"] == name and t["status"] == "active"
    assert (await admin.get(f"/tenants/{t['id']}")).json() == t

    r = await admin.post("/tenants", json={"name": name, "weight": 3})
    assert r.status_code == 409 and err(r)["param"] == "name" and err(r)["code"] == "conflict", r.text

    bad = [
        ({"weight": -1}, "weight"),
        ({"weight": 0}, "weight"),
        ({"service_tiers": ["gold"]}, "service_tiers"),
        ({"service_tiers": []}, "service_tiers"),
        ({"service_tiers": ["flex"], "default_tier": "priority"}, "default_tier"),
        ({"service_tiers": ["flex"]}, "default_tier"),
        ({"default_tier": "gold"}, "default_tier"),
        ({"status": "deleted"}, "status"),
        ({"bogus": 1}, "bogus"),
        ({"quota": {"requests_per_minute": -5}}, "quota"),
        ({"quota": {"rpm": 5}}, "quota"),
        ({"name": "bad name!"}, "name"),
        ({"name": ""}, "name"),
        ({"models": "tiny"}, "models"),
    ]
    for fields, param in bad:
        body = {"name": "bad-" + secrets.token_hex(4), **fields}
        r = await admin.post("/tenants", json=body)
        assert r.status_code == 400, (fields, r.text)
        got = err(r)["param"] or ""
        assert re.split(r"[.\[]", got)[0] == param, (fields, r.text)
        if body["name"].startswith("bad-"):
            # nothing was created under that name
            again = await admin.post("/tenants", json={"name": body["name"]})
            assert again.status_code == 201, (fields, again.text)

    r = await admin.post(f"/tenants/{t['id']}/keys", json={"name": "root", "scopes": ["admin"]})
    assert r.status_code == 400 and err(r)["param"] == "scopes", r.text
    r = await admin.post(f"/tenants/{t['id']}/keys", json={"name": "root", "scopes": ["root"]})
    assert r.status_code == 400 and err(r)["param"].startswith("scopes"), r.text
    r = await admin.post(f"/tenants/{t['id']}/keys",
                         json={"name": "old", "expires_at": "2000-01-01T00:00:00Z"})
    assert r.status_code == 400 and err(r)["param"] == "expires_at", r.text
    assert (await admin.get(f"/tenants/{t['id']}/keys")).json()["data"] == []
    assert (await admin.get("/tenants/nope")).status_code == 404
    assert (await admin.get("/keys/nope")).status_code == 404


async def test_admin_pagination_returns_each_tenant_once(ctx):
    admin = ctx.admin
    mine = set()
    for i in range(7):
        r = await admin.post("/tenants", json={"name": f"page-{secrets.token_hex(3)}-{i}"})
        assert r.status_code == 201
        mine.add(r.json()["id"])
    seen: list[str] = []
    after = None
    for _ in range(1000):
        r = await admin.get("/tenants", params={"limit": 3, **({"after": after} if after else {})})
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["data"]) <= 3
        seen += [t["id"] for t in page["data"]]
        if not page["has_more"]:
            break
        assert len(page["data"]) == 3 and page["last_id"] == page["data"][-1]["id"]
        after = page["last_id"]
    else:
        pytest.fail("pagination never ended")
    assert len(seen) == len(set(seen)), "a tenant appeared twice"
    assert mine <= set(seen)
    everything = [t["id"] for t in (await admin.get("/tenants", params={"limit": 500})).json()["data"]]
    assert seen == everything
    assert (await admin.get("/tenants", params={"limit": 0})).status_code == 400
    assert (await admin.get("/tenants", params={"limit": 501})).status_code == 400


async def test_admin_changes_are_audited_and_atomic(ctx):
    admin = ctx.admin
    # a second admin key, so the actor is unambiguous
    r = await admin.post("/keys", json={"name": "auditor"})
    assert r.status_code == 201, r.text
    auditor = r.json()
    assert auditor["scopes"] == ["admin"] and auditor["tenant_id"] is None
    ctx.issued.append(auditor["key"])
    aud = ctx.gw.client(auditor["key"], base_url=ctx.gw.url + "/admin/v1")
    try:
        t = (await aud.post("/tenants", json={"name": "aud-" + secrets.token_hex(4)})).json()
        other = (await aud.post("/tenants", json={"name": "aud-" + secrets.token_hex(4)})).json()
        quota = {"requests_per_minute": 7, "tokens_per_minute": 700, "max_concurrent_requests": 2,
                 "daily_token_budget": None, "monthly_token_budget": 99999}
        r = await aud.put(f"/tenants/{t['id']}/quota", json=quota)
        assert r.status_code == 200 and r.json()["quota"] == quota, r.text
        assert (await aud.get(f"/tenants/{t['id']}")).json()["quota"] == quota
        r = await aud.put(f"/tenants/{t['id']}/quota", json={"requests_per_minute": -1})
        assert r.status_code == 400 and err(r)["param"] == "requests_per_minute"
        r = await aud.patch(f"/tenants/{t['id']}", json={"weight": 2.5})
        assert r.status_code == 200 and r.json()["weight"] == 2.5
        k = (await aud.post(f"/tenants/{t['id']}/keys", json={"name": "k1"})).json()
        ctx.issued.append(k["key"])
        assert (await aud.delete(f"/keys/{k['id']}")).json()["revoked"] is True

        # failed changes change nothing and write no audit entry
        snapshot = (await aud.get(f"/tenants/{t['id']}")).json()
        newest = (await aud.get("/audit", params={"limit": 1})).json()["data"][0]["id"]
        failing = [
            ({"weight": 9, "service_tiers": ["gold"]}, 400, "service_tiers"),
            ({"weight": 9, "bogus": True}, 400, "bogus"),
            ({"weight": 9, "service_tiers": ["flex"]}, 400, "service_tiers"),   # lacks its default
            ({"weight": 9, "default_tier": "flex", "service_tiers": ["default"]}, 400, "default_tier"),
            ({"weight": 9, "name": other["name"]}, 409, "name"),
            ({"weight": 9, "name": None}, 400, "name"),
            ({"weight": 9, "status": "gone"}, 400, "status"),
            ({}, 400, None),
        ]
        for body, status, param in failing:
            r = await aud.patch(f"/tenants/{t['id']}", json=body)
            assert r.status_code == status, (body, r.text)
            if param:
                assert re.split(r"[.\[]", err(r)["param"] or "")[0] == param, (body, r.text)
            assert (await aud.get(f"/tenants/{t['id']}")).json() == snapshot, body
        assert (await aud.get("/audit", params={"limit": 1})).json()["data"][0]["id"] == newest

        r = await aud.delete(f"/tenants/{t['id']}")
        assert r.status_code == 200 and r.json()["deleted"] is True
        entries = (await aud.get("/audit", params={"limit": 1000})).json()["data"]
    finally:
        await aud.aclose()
    by_me = [(e["action"], e["target_id"]) for e in entries if e["actor"] == auditor["id"]]
    for expected in [("tenant.create", t["id"]), ("tenant.create", other["id"]),
                     ("tenant.set_quota", t["id"]), ("tenant.update", t["id"]),
                     ("key.create", k["id"]), ("key.revoke", k["id"]), ("tenant.delete", t["id"])]:
        assert expected in by_me, (expected, by_me)
    assert sum(a == "tenant.update" and tid == t["id"] for a, tid in by_me) == 1
    # newest first; the bootstrap admin key's own changes carry its id, not "bootstrap"
    ids = [e["id"] for e in entries]
    assert ids == sorted(ids, reverse=True)
    boot = [e for e in entries if e["action"] == "key.bootstrap"]
    assert boot and all(e["actor"] == "bootstrap" for e in boot)
    boot_ids = {e["target_id"] for e in boot}
    created_by_bootstrap_key = [e for e in entries if e["actor"] in boot_ids]
    assert any(e["target_id"] == auditor["id"] and e["action"] == "key.create"
               for e in created_by_bootstrap_key)
    # the audit trail holds no key material
    leaks = find_leaks(str(entries), ctx.issued)
    assert not leaks, leaks


# == 5. key and tenant life cycle =================================================================
async def test_expired_key(ctx):
    t, _ = await ctx.tenant()
    # 3 s: time to use it twice, the second time after the first lookup left the key cache
    # (key_cache_ttl_s, 2 s), so a cached principal outlives the expiry by ~1.5 s unless the
    # gateway checks expires_at on cache hits too
    expires = datetime.now(UTC) + timedelta(seconds=3)
    k = await ctx.new_key(t["id"], name="short", expires_at=expires.isoformat())
    assert k["expires_at"] is not None
    r = await ctx.call("GET", "/v1/models", k["key"])
    assert r.status_code == 200, r.text          # works
    assert (await ctx.chat(k["key"])).status_code == 200
    await asyncio.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds() - 0.7))
    r = await ctx.call("GET", "/v1/models", k["key"])
    assert r.status_code == 200, r.text          # still works, looked up (and cached) afresh
    refused_at: list[datetime] = []

    async def refused() -> bool:
        r = await ctx.call("GET", "/v1/models", k["key"])
        if r.status_code == 401:
            refused_at.append(datetime.now(UTC))
            return True
        assert r.status_code == 200, r.text
        return False

    ok, _ = await poll(refused, timeout=8, every=0.2)
    assert ok, "an expired key still works"
    assert refused_at[0] >= expires - timedelta(milliseconds=300), "refused before it expired"
    # at once, not when a cached principal happens to age out
    assert refused_at[0] - expires < timedelta(seconds=1), refused_at[0] - expires
    for r in (await ctx.call("GET", "/v1/models", k["key"]), await ctx.chat(k["key"])):
        assert r.status_code == 401 and err(r)["code"] == "expired", r.text


async def test_suspended_tenant(ctx):
    t, key = await ctx.tenant()
    assert (await ctx.chat(key)).status_code == 200
    r = await ctx.admin.patch(f"/tenants/{t['id']}", json={"status": "suspended"})
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    ok, elapsed = await poll(lambda: status_is(ctx.chat(key), 401))
    assert ok and elapsed < 5, elapsed
    assert elapsed < 0.5, f"the changing server itself took {elapsed:.2f}s (its key cache)"
    r = await ctx.chat(key)
    assert err(r)["code"] == "tenant_suspended", r.text
    # a key made while suspended is refused too
    k2 = await ctx.new_key(t["id"], name="while-suspended")
    assert err(await ctx.call("GET", "/v1/models", k2["key"]))["code"] == "tenant_suspended"
    r = await ctx.admin.patch(f"/tenants/{t['id']}", json={"status": "active"})
    assert r.status_code == 200 and r.json()["status"] == "active"
    ok, elapsed = await poll(lambda: status_is(ctx.chat(key), 200))
    assert ok and elapsed < 5, elapsed
    assert (await ctx.call("GET", "/v1/models", k2["key"])).status_code == 200


async def test_deleted_tenant(ctx):
    admin = ctx.admin
    t, key = await ctx.tenant()
    for _ in range(2):
        assert (await ctx.chat(key)).status_code == 200
    total_before = (await admin.get("/usage")).json()["data"][0]["requests"]
    r = await admin.delete(f"/tenants/{t['id']}")
    assert r.status_code == 200 and r.json() == {"id": t["id"], "object": "tenant", "deleted": True}
    r = await ctx.chat(key)
    assert r.status_code == 401 and err(r)["code"] == "tenant_deleted", r.text
    assert (await ctx.call("GET", "/v1/usage", key)).status_code == 401
    for method, path in (("GET", f"/tenants/{t['id']}"), ("GET", f"/tenants/{t['id']}/keys"),
                         ("PATCH", f"/tenants/{t['id']}"), ("DELETE", f"/tenants/{t['id']}"),
                         ("PUT", f"/tenants/{t['id']}/quota"), ("POST", f"/tenants/{t['id']}/keys")):
        body = {"PATCH": {"weight": 2}, "POST": {"name": "x"}, "PUT": {}}.get(method)
        r = await admin.request(method, path, **({"json": body} if body is not None else {}))
        assert r.status_code == 404 and err(r)["code"] == "not_found", (method, path, r.text)
    assert t["id"] not in [x["id"] for x in (await admin.get("/tenants", params={"limit": 500})).json()["data"]]
    # its name is not reused
    assert (await admin.post("/tenants", json={"name": t["name"]})).status_code == 409
    # usage rows are kept: in the database, and in the all-tenant report
    n = db_query(ctx.gw, "SELECT COUNT(*) FROM usage_records WHERE tenant_id = ?", (t["id"],))[0][0]
    assert n == 2
    assert (await admin.get("/usage")).json()["data"][0]["requests"] == total_before
    # per-tenant: a deleted tenant is not found (its rows still count in the totals above)
    r = await admin.get("/usage", params={"tenant_id": t["id"]})
    if r.status_code == 200:
        assert r.json()["data"][0]["requests"] == 2, r.text
    else:
        assert r.status_code == 404 and err(r)["code"] == "not_found", r.text
    # the key rows are revoked, not removed
    rows = db_query(ctx.gw, "SELECT revoked_at FROM api_keys WHERE tenant_id = ?", (t["id"],))
    assert rows and all(rv is not None for (rv,) in rows)


# == 4. revocation (on a second replica too: tests/gateway/test_gateway_replicas.py) =================
async def test_revocation_is_seen_at_once_by_the_revoking_gateway(ctx):
    """A revoked key is refused (`revoked`) by the gateway that revoked it at once, though it
    was cached there; revoking it again changes nothing; other keys keep working."""
    t, _ = await ctx.tenant()
    k = await ctx.new_key(t["id"], name="to-revoke")
    _, key2 = await ctx.tenant()

    async def status(key: str) -> httpx.Response:
        return await ctx.call("GET", "/v1/models", key)

    # warm: the key is cached
    assert (await status(k["key"])).status_code == 200
    assert (await status(key2)).status_code == 200
    r = await ctx.admin.delete(f"/keys/{k['id']}")
    assert r.status_code == 200 and r.json()["revoked"] is True
    ok, elapsed = await poll(lambda: status_is(status(k["key"]), 401))
    assert ok and elapsed < 5, f"revoked key still accepted after {elapsed:.2f}s"
    assert err(await status(k["key"]))["code"] == "revoked"
    assert elapsed < 0.5, elapsed        # the revoking gateway forgets it at once
    got = (await ctx.admin.get(f"/keys/{k['id']}")).json()
    assert got["revoked_at"] is not None
    # revoking again changes nothing
    assert (await ctx.admin.delete(f"/keys/{k['id']}")).status_code == 200
    assert (await ctx.admin.get(f"/keys/{k['id']}")).json()["revoked_at"] == got["revoked_at"]
    assert (await status(key2)).status_code == 200


# == 3. no key material at rest or in logs ==========================================================
async def test_no_key_material_persists(ctx, tenants):
    gw = ctx.gw
    a, key_a, _, _ = tenants
    extra = await ctx.new_key(a["id"], name="extra")
    # limited tenant and key: the limiter keeps state (in Redis on the services backend)
    limited, _ = await ctx.tenant(quota={"requests_per_minute": 100, "daily_token_budget": 10**6})
    limited_key = await ctx.new_key(limited["id"], name="limited",
                                    quota={"tokens_per_minute": 10**5, "max_concurrent_requests": 4})
    r = await ctx.chat(limited_key["key"])
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100", r.text
    # exercise the request paths (and their logging) with every kind of key
    bad = "lg-" + secrets.token_urlsafe(32)
    bad_same_prefix = key_a[:15] + secrets.token_urlsafe(24)       # a real prefix, a wrong secret
    ctx.probed += [bad, bad_same_prefix]
    assert (await ctx.chat(extra["key"], header="x-api-key")).status_code == 200
    assert (await ctx.chat(key_a)).status_code == 200
    assert (await ctx.call("POST", "/v1/completions", key_a, json={"model": "tiny", "prompt": "x",
                                                                   "max_tokens": 1})).status_code == 200
    for key in (bad, bad_same_prefix):
        for header in ("bearer", "x-api-key"):
            assert (await ctx.chat(key, header=header)).status_code == 401
            assert (await ctx.call("GET", "/admin/v1/tenants", key, header=header)).status_code == 401
    assert (await ctx.call("GET", "/admin/v1/engine", gw.admin_key, header="x-api-key")).status_code == 200
    assert (await ctx.call("GET", "/v1/models", gw.admin_key)).status_code == 403
    r = await ctx.call("POST", "/v1/chat/completions", key_a, json={"model": "tiny", "messages": "oops"})
    assert r.status_code == 400
    assert (await ctx.admin.delete(f"/keys/{extra['id']}")).status_code == 200
    assert (await ctx.chat(extra["key"])).status_code == 401
    time.sleep(0.5)       # background last-used updates

    keys = list(dict.fromkeys(ctx.issued + ctx.probed))
    assert len(ctx.issued) >= 6, "too few keys issued for this test to mean much"

    # the database: every row of every table
    dump = db_dump(gw)
    assert {"tenants", "api_keys", "usage_records", "audit_entries"} <= set(dump), sorted(dump)
    text = "\n".join(f"{t}: {row!r}" for t, rows in dump.items() for row in rows)
    leaks = find_leaks(text, keys)
    assert not leaks, f"key material in the database: {leaks[:5]}"
    # ... which stores a peppered HMAC per key, and its lookup prefix in clear
    if ctx.backend == "embedded":
        pepper = keymod.load_or_create_pepper(gw.data_dir)
        assert stat.S_IMODE(os.stat(gw.data_dir / "pepper").st_mode) == 0o600
    else:
        pepper = keymod.pepper_from_setting(gw.settings.pepper.get_secret_value())
    stored = {p: h for p, h in db_query(gw, "SELECT prefix, secret_hash FROM api_keys")}
    for key in ctx.issued:
        prefix = keymod.lookup_prefix(key)
        assert stored.get(prefix) == keymod.hash_secret(key, pepper), prefix

    # Redis (services): the limiter's state names ids, never keys
    if ctx.backend == "services":
        import redis

        client = redis.Redis.from_url(gw.settings.redis_url)
        try:
            chunks = []
            for name in client.scan_iter(match=gw.settings.redis_prefix + "*", count=1000):
                kind = client.type(name).decode()
                value = {"string": client.get, "hash": client.hgetall,
                         "zset": lambda n: client.zrange(n, 0, -1, withscores=True),
                         "set": client.smembers, "list": lambda n: client.lrange(n, 0, -1)}.get(
                             kind, lambda n: None)(name)
                chunks.append(f"{name!r} {value!r}")
        finally:
            client.close()
        assert chunks, "no limiter state in Redis at all"
        leaks = find_leaks("\n".join(chunks), keys)
        assert not leaks, f"key material in Redis: {leaks[:5]}"

    # the logs (INFO level, as `lockgate -v serve`), and every file under the data directory
    log = gw.log()
    assert re.search(r" INFO [\w.]+: ", log), "the gateway did not log at INFO level:\n" + log[-2000:]
    assert re.search(r" INFO sqlalchemy\.engine\.\w+: SELECT ", log), "no SQL statement logged"
    leaks = find_leaks(log, keys)
    assert not leaks, f"key material in the gateway's log: {leaks[:5]}"
    files = sorted(p for p in Path(gw.data_dir).rglob("*") if p.is_file())
    names = {p.name for p in files}
    if ctx.backend == "embedded":
        assert {"lockgate.db", "pepper", "demo_key"} <= names, names
    else:
        assert not names & {"lockgate.db", "pepper", "demo_key", "admin_key"}, names
    assert "admin_key" not in names        # LOCKGATE_ADMIN_KEY was given: nothing to show
    demo_keys = []
    for p in files:
        data = p.read_bytes().decode("latin-1")
        if p.name == "demo_key":
            # the one file that holds a key, on purpose: owner-only
            assert stat.S_IMODE(p.stat().st_mode) == 0o600, oct(p.stat().st_mode)
            demo_keys = re.findall(r"lg-[A-Za-z0-9_-]{20,}", data)
            assert demo_keys, data
            continue
        leaks = find_leaks(data, keys)
        assert not leaks, f"key material in {p}: {leaks[:5]}"
    # the demo key is shown once: in that file only
    for dk in set(demo_keys):
        leaks = find_leaks(text + log, [dk])
        assert not leaks, f"the demo key outside its file: {leaks[:5]}"
    if demo_keys:
        assert (await ctx.call("GET", "/v1/models", demo_keys[0])).status_code == 200
