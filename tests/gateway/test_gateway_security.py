"""Security acceptance tests against a live `lockgate serve`, on both backends (SQLite + the
in-process limiter; PostgreSQL + Redis): tenant isolation, admin-route authorization, no key
material at rest or in logs, revocation (also across replicas), key/tenant life cycle, and the
admin API's validation, pagination, audit and atomicity.

The route lists are enumerated from `create_app().routes`, so a route added later is covered
without editing this file (a new path parameter name makes the isolation test fail until it is
given a value below)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import sqlite3
import stat
import subprocess
import time
import types
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import httpx
import pytest
from pydantic import BaseModel

from lockgate.gateway.admin.vllm_lora import PATHS as VLLM_ADMIN_PATHS
from lockgate.tenancy import keys as keymod
from tests.support import gateway_server
from tests.support.gateway_server import GatewayServer, running_server
from tests.support.helpers import demo_model

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


# -- the live servers ---------------------------------------------------------------------------
@contextlib.contextmanager
def verbose_cli():
    """`lockgate -v serve ...` (`-v` is a global option, before the subcommand, which
    GatewayServer's extra_args cannot place): INFO logging, SQLAlchemy's statements included."""
    real = subprocess.Popen

    def popen(args, *a, **kw):
        args = list(args)
        if args[1:3] == ["-m", "lockgate.gateway.cli"]:
            args.insert(3, "-v")
        return real(args, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gateway_server.subprocess, "Popen", popen)
        yield


class Ctx:
    """A server plus every key this module was handed (for the key-material test)."""

    def __init__(self, srv: GatewayServer, backend: str) -> None:
        self.srv = srv
        self.backend = backend
        self.http = httpx.Client(base_url=srv.url, timeout=60)
        self.issued: list[str] = [srv.admin_key]
        self.probed: list[str] = []          # keys presented that were never valid

    def tenant(self, name: str | None = None, **fields) -> tuple[dict, str]:
        t, key = self.srv.tenant(name or "t-" + secrets.token_hex(5), **fields)
        self.issued.append(key)
        return t, key

    def new_key(self, tenant_id: str, **body) -> dict:
        r = self.srv.admin.post(f"/tenants/{tenant_id}/keys", json={"name": "k", **body})
        assert r.status_code == 201, r.text
        self.issued.append(r.json()["key"])
        return r.json()

    def call(self, method: str, path: str, key: str | None = None, *, header: str = "bearer",
             **kw) -> httpx.Response:
        headers = dict(kw.pop("headers", {}))
        if key is not None:
            if header == "bearer":
                headers["Authorization"] = f"Bearer {key}"
            else:
                headers["x-api-key"] = key
        return self.http.request(method, path, headers=headers, **kw)

    def chat(self, key: str, model: str = "tiny", **kw) -> httpx.Response:
        return self.call("POST", "/v1/chat/completions", key, json={
            "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
            **kw)


@pytest.fixture(scope="module", params=["embedded", "services"])
def ctx(request, tmp_path_factory):
    models = {"tiny": demo_model("llama", "tiny", 0), "b-private": demo_model("llama", "tiny", 1)}
    with contextlib.ExitStack() as stack:
        with verbose_cli():
            srv = stack.enter_context(running_server(
                tmp_path_factory.mktemp(f"sec-{request.param}"), request.param, models=models,
                private_models=("b-private",)))
        c = Ctx(srv, request.param)
        stack.callback(c.http.close)
        yield c


@pytest.fixture(scope="module")
def tenants(ctx):
    """Tenant A (public models only) and tenant B (also the private model b-private)."""
    a, key_a = ctx.tenant("iso-a-" + secrets.token_hex(4))
    b, key_b = ctx.tenant("iso-b-" + secrets.token_hex(4), models=["tiny", "b-private"])
    return a, key_a, b, key_b


def err(r: httpx.Response) -> dict:
    return r.json().get("error") or {}


def poll(fn, timeout: float = 5.0, every: float = 0.25) -> tuple[bool, float]:
    """Call `fn` until it returns true or `timeout` passes: (succeeded, elapsed seconds)."""
    t0 = time.monotonic()
    while True:
        if fn():
            return True, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, time.monotonic() - t0
        time.sleep(every)


# -- direct database access -------------------------------------------------------------------
def _pg_conninfo(srv: GatewayServer) -> str | None:
    url = srv.env.get("LOCKGATE_DATABASE_URL")
    if not url:
        return None
    return re.sub(r"^postgresql\+\w+://", "postgresql://", url)


def db_query(srv: GatewayServer, sql: str, params: tuple = ()) -> list[tuple]:
    """Run one SELECT on the server's database; `?` placeholders on both backends."""
    conninfo = _pg_conninfo(srv)
    if conninfo is None:
        con = sqlite3.connect(srv.data_dir / "lockgate.db", timeout=10)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as con:
        return con.execute(sql.replace("?", "%s"), params).fetchall()


def db_dump(srv: GatewayServer) -> dict[str, list[tuple]]:
    """Every row of every table."""
    conninfo = _pg_conninfo(srv)
    if conninfo is None:
        tables = [r[0] for r in db_query(srv, "SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: db_query(srv, f'SELECT * FROM "{t}"') for t in tables}  # noqa: S608 - names from sqlite_master
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
def test_private_model_and_usage_isolation(ctx, tenants):
    a, key_a, b, key_b = tenants
    # B uses its private model on both endpoints and sees it
    r = ctx.chat(key_b, "b-private")
    assert r.status_code == 200, r.text
    r = ctx.call("POST", "/v1/completions", key_b,
                 json={"model": "b-private", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert ctx.chat(key_b, "tiny").status_code == 200
    assert ctx.call("GET", "/v1/models/b-private", key_b).json()["id"] == "b-private"
    listed = ctx.call("GET", "/v1/models", key_b).json()["data"]
    assert {m["id"] for m in listed} == {"tiny", "b-private"}
    # A: the private model does not exist
    assert ctx.chat(key_a, "tiny").status_code == 200
    for r in (ctx.chat(key_a, "b-private"),
              ctx.chat(key_a, "b-private", header="x-api-key"),
              ctx.call("POST", "/v1/completions", key_a,
                       json={"model": "b-private", "prompt": "x", "max_tokens": 2}),
              ctx.call("GET", "/v1/models/b-private", key_a)):
        assert r.status_code == 404, r.text
        assert err(r)["code"] == "model_not_found"
    ids = [m["id"] for m in ctx.call("GET", "/v1/models", key_a).json()["data"]]
    assert ids == ["tiny"]

    # usage: B's rows exist (the admin sees 3) but A never gets them
    r = ctx.srv.admin.get("/usage", params={"tenant_id": b["id"]})
    assert r.status_code == 200 and r.json()["data"][0]["requests"] == 3, r.text
    r = ctx.call("GET", "/v1/usage", key_a, params={"tenant_id": b["id"]})
    assert r.status_code == 403, r.text
    assert err(r)["code"] == "permission_denied" and "data" not in r.json()
    for params in ({}, {"tenant_id": a["id"]}, {"group_by": "model"},
                   [("tenant_id", a["id"]), ("tenant_id", b["id"])],
                   [("tenant_id", b["id"]), ("tenant_id", a["id"])]):
        r = ctx.call("GET", "/v1/usage", key_a, params=params)
        if r.status_code == 403:
            continue
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tenant_id"] == a["id"] and b["id"] not in r.text
        assert sum(g["requests"] for g in body["data"]) == 1, (params, body)   # A's one request
        assert all(g["group"] in (None, "tiny") for g in body["data"]), body
    r = ctx.call("GET", "/v1/usage", key_a, params={"format": "csv", "group_by": "model"})
    assert r.status_code == 200 and "b-private" not in r.text


def test_path_parameter_routes_refuse_another_tenants_objects(ctx, tenants, app_routes):
    """Every route with a path parameter, called with A's key on B's tenant, key and model:
    never 2xx, never B's data, and B is unchanged afterwards."""
    _, key_a, b, key_b = tenants
    b_keys = ctx.srv.admin.get(f"/tenants/{b['id']}/keys").json()["data"]
    b_key = next(k for k in b_keys if key_b.startswith(keymod.KEY_PREFIX + k["prefix"]))
    # B's own file and batch (the Batch API): A's key must not reach them either
    line = json.dumps({"custom_id": "b-secret", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": "b", "max_tokens": 1}})
    r = ctx.call("POST", "/v1/files", key_b, data={"purpose": "batch"},
                 files={"file": ("b.jsonl", line.encode())})
    assert r.status_code == 200, r.text
    b_file = r.json()["id"]
    r = ctx.call("POST", "/v1/batches", key_b, json={"input_file_id": b_file, "endpoint": "/v1/completions",
                                                     "completion_window": "24h"})
    assert r.status_code == 200, r.text
    b_batch = r.json()["id"]
    values = {"tenant_id": b["id"], "key_id": b_key["id"], "model_id": "b-private",
              "adapter_id": "ada_0000000000000000", "file_id": b_file, "batch_id": b_batch}
    b_data = {b["name"], b["id"], b_key["id"], b_key["prefix"], key_b,
              demo_model("llama", "tiny", 1), b_file, b_batch, "b-secret"}
    before = ctx.srv.admin.get(f"/tenants/{b['id']}").json()

    checked = []
    for path, methods, model in app_routes:
        if "{" not in path:
            continue
        url = fill(path, values)
        secret = {s for s in b_data if s not in url}     # an echo of the URL is no leak
        for method in sorted(methods):
            for header in ("bearer", "x-api-key"):
                kw = {"json": valid_body(model)} if method in MUTATING else {}
                r = ctx.call(method, url, key_a, header=header, **kw)
                what = f"{method} {url} ({header}) -> {r.status_code} {r.text[:300]}"
                assert not 200 <= r.status_code < 300, what
                assert r.status_code in (401, 403, 404), what
                leaked = [s for s in secret if s in r.text]
                assert not leaked, f"{what}: B's data {leaked}"
            checked.append(f"{method} {path}")
    assert any(p.startswith("GET /v1/models/") for p in checked), checked
    assert sum("{tenant_id}" in p for p in checked) >= 4, checked

    # nothing of B's changed, its key still works
    assert ctx.srv.admin.get(f"/tenants/{b['id']}").json() == before
    after = ctx.srv.admin.get(f"/tenants/{b['id']}/keys").json()["data"]
    assert [(k["id"], k["revoked_at"]) for k in after] == [(k["id"], k["revoked_at"]) for k in b_keys]
    assert ctx.chat(key_b, "b-private").status_code == 200
    assert ctx.call("GET", f"/v1/files/{b_file}", key_b).status_code == 200
    assert ctx.call("GET", f"/v1/batches/{b_batch}", key_b).json()["status"] != "cancelling"


# == 2. admin routes need an admin key ================================================================
def test_every_admin_route_needs_an_admin_key(ctx, tenants, app_routes):
    a, key_a, _, _ = tenants
    admin_routes = [(p, m, b) for p, m, b in app_routes if is_admin_route(p)]
    assert set(VLLM_ADMIN_PATHS) <= {p for p, _, _ in admin_routes}
    pairs = [(p, meth) for p, m, _ in admin_routes for meth in sorted(m)]
    assert len(pairs) >= 10, pairs
    assert {"POST", "GET", "PATCH", "PUT", "DELETE"} <= {m for _, m in pairs}
    a_key_id = ctx.srv.admin.get(f"/tenants/{a['id']}/keys").json()["data"][0]["id"]
    # a tenant's key aimed at its own tenant and key: the most plausible escalation
    values = {"tenant_id": a["id"], "key_id": a_key_id, "adapter_id": "ada_0000000000000000",
              "batch_id": "batch_0000"}
    bogus = "lg-" + secrets.token_urlsafe(32)
    ctx.probed.append(bogus)
    invalid_bodies = [{"bogus": 1, "name": 7}, [1, 2], "text"]
    before = ctx.srv.admin.get(f"/tenants/{a['id']}").json()
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
                r = ctx.call(method, url, key, header=header, **kw)
                what = (f"{method} {url} key={key and key[:8]} body={body!r}: "
                        f"{r.status_code} {r.text[:200]}")
                assert r.status_code == status, what
                assert err(r)["code"] == code, what
    # an Authorization header without a usable bearer key: 401, whatever else is sent
    for value in ("Bearer", f"Basic {ctx.srv.admin_key}", f"Token {ctx.srv.admin_key}"):
        r = ctx.call("GET", "/admin/v1/tenants", headers={"Authorization": value,
                                                          "x-api-key": ctx.srv.admin_key})
        assert r.status_code == 401, (value[:8], r.text)
    # nothing changed for A, and A's key still works
    assert ctx.srv.admin.get(f"/tenants/{a['id']}").json() == before
    assert ctx.chat(key_a).status_code == 200


def test_admin_key_cannot_call_tenant_routes(ctx, app_routes):
    v1 = [(p, m, b) for p, m, b in app_routes if p.startswith("/v1/") and not is_admin_route(p)]
    assert {p for p, _, _ in v1} >= {"/v1/chat/completions", "/v1/completions", "/v1/models"}
    for path, methods, _ in v1:
        url = fill(path, {"model_id": "tiny", "file_id": "file-0000", "batch_id": "batch_0000"})
        for method in sorted(methods):
            kw = {"json": {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                           "prompt": "x", "max_tokens": 1}} if method in MUTATING else {}
            for header in ("bearer", "x-api-key"):
                r = ctx.call(method, url, ctx.srv.admin_key, header=header, **kw)
                assert r.status_code == 403, f"{method} {url}: {r.status_code} {r.text}"
                assert err(r)["code"] == "admin_key_not_allowed"


def test_admin_auth_precedes_malformed_json(ctx, app_routes):
    """Admin routes authenticate before reading the body (gateway.admin.AdminRoute)."""
    posts = [p for p, m, _ in app_routes if is_admin_route(p) and "POST" in m]
    for path in posts:
        r = ctx.call("POST", fill(path, {"tenant_id": "x", "adapter_id": "x", "batch_id": "x"}), content=b"{not json",
                     headers={"content-type": "application/json"})
        assert r.status_code == 401, f"POST {path}: {r.status_code} {r.text}"


# == 6. the admin API ==============================================================================
def test_admin_tenant_validation_and_conflicts(ctx):
    admin = ctx.srv.admin
    name = "adm-" + secrets.token_hex(4)
    r = admin.post("/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    t = r.json()
    assert t["id"] and t["object"] == "tenant" and t["name"] == name and t["status"] == "active"
    assert admin.get(f"/tenants/{t['id']}").json() == t

    r = admin.post("/tenants", json={"name": name, "weight": 3})
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
        r = admin.post("/tenants", json=body)
        assert r.status_code == 400, (fields, r.text)
        got = err(r)["param"] or ""
        assert re.split(r"[.\[]", got)[0] == param, (fields, r.text)
        if body["name"].startswith("bad-"):
            # nothing was created under that name
            again = admin.post("/tenants", json={"name": body["name"]})
            assert again.status_code == 201, (fields, again.text)

    r = admin.post(f"/tenants/{t['id']}/keys", json={"name": "root", "scopes": ["admin"]})
    assert r.status_code == 400 and err(r)["param"] == "scopes", r.text
    r = admin.post(f"/tenants/{t['id']}/keys", json={"name": "root", "scopes": ["root"]})
    assert r.status_code == 400 and err(r)["param"].startswith("scopes"), r.text
    r = admin.post(f"/tenants/{t['id']}/keys",
                   json={"name": "old", "expires_at": "2000-01-01T00:00:00Z"})
    assert r.status_code == 400 and err(r)["param"] == "expires_at", r.text
    assert admin.get(f"/tenants/{t['id']}/keys").json()["data"] == []
    assert admin.get("/tenants/nope").status_code == 404
    assert admin.get("/keys/nope").status_code == 404


def test_admin_pagination_returns_each_tenant_once(ctx):
    admin = ctx.srv.admin
    mine = set()
    for i in range(7):
        r = admin.post("/tenants", json={"name": f"page-{secrets.token_hex(3)}-{i}"})
        assert r.status_code == 201
        mine.add(r.json()["id"])
    seen: list[str] = []
    after = None
    for _ in range(1000):
        r = admin.get("/tenants", params={"limit": 3, **({"after": after} if after else {})})
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
    everything = [t["id"] for t in admin.get("/tenants", params={"limit": 500}).json()["data"]]
    assert seen == everything
    assert admin.get("/tenants", params={"limit": 0}).status_code == 400
    assert admin.get("/tenants", params={"limit": 501}).status_code == 400


def test_admin_changes_are_audited_and_atomic(ctx):
    admin = ctx.srv.admin
    # a second admin key, so the actor is unambiguous
    r = admin.post("/keys", json={"name": "auditor"})
    assert r.status_code == 201, r.text
    auditor = r.json()
    assert auditor["scopes"] == ["admin"] and auditor["tenant_id"] is None
    ctx.issued.append(auditor["key"])
    aud = httpx.Client(base_url=ctx.srv.url + "/admin/v1", timeout=30,
                       headers={"Authorization": f"Bearer {auditor['key']}"})
    try:
        t = aud.post("/tenants", json={"name": "aud-" + secrets.token_hex(4)}).json()
        other = aud.post("/tenants", json={"name": "aud-" + secrets.token_hex(4)}).json()
        quota = {"requests_per_minute": 7, "tokens_per_minute": 700, "max_concurrent_requests": 2,
                 "daily_token_budget": None, "monthly_token_budget": 99999}
        r = aud.put(f"/tenants/{t['id']}/quota", json=quota)
        assert r.status_code == 200 and r.json()["quota"] == quota, r.text
        assert aud.get(f"/tenants/{t['id']}").json()["quota"] == quota
        r = aud.put(f"/tenants/{t['id']}/quota", json={"requests_per_minute": -1})
        assert r.status_code == 400 and err(r)["param"] == "requests_per_minute"
        r = aud.patch(f"/tenants/{t['id']}", json={"weight": 2.5})
        assert r.status_code == 200 and r.json()["weight"] == 2.5
        k = aud.post(f"/tenants/{t['id']}/keys", json={"name": "k1"}).json()
        ctx.issued.append(k["key"])
        assert aud.delete(f"/keys/{k['id']}").json()["revoked"] is True

        # failed changes change nothing and write no audit entry
        snapshot = aud.get(f"/tenants/{t['id']}").json()
        newest = aud.get("/audit", params={"limit": 1}).json()["data"][0]["id"]
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
            r = aud.patch(f"/tenants/{t['id']}", json=body)
            assert r.status_code == status, (body, r.text)
            if param:
                assert re.split(r"[.\[]", err(r)["param"] or "")[0] == param, (body, r.text)
            assert aud.get(f"/tenants/{t['id']}").json() == snapshot, body
        assert aud.get("/audit", params={"limit": 1}).json()["data"][0]["id"] == newest

        r = aud.delete(f"/tenants/{t['id']}")
        assert r.status_code == 200 and r.json()["deleted"] is True
        entries = aud.get("/audit", params={"limit": 1000}).json()["data"]
    finally:
        aud.close()
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
def test_expired_key(ctx):
    t, _ = ctx.tenant()
    # 3 s: time to use it twice, the second time after the first lookup left the key cache
    # (key_cache_ttl_s, 2 s), so a cached principal outlives the expiry by ~1.5 s unless the
    # gateway checks expires_at on cache hits too
    expires = datetime.now(UTC) + timedelta(seconds=3)
    k = ctx.new_key(t["id"], name="short", expires_at=expires.isoformat())
    assert k["expires_at"] is not None
    r = ctx.call("GET", "/v1/models", k["key"])
    assert r.status_code == 200, r.text          # works
    assert ctx.chat(k["key"]).status_code == 200
    time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds() - 0.7))
    r = ctx.call("GET", "/v1/models", k["key"])
    assert r.status_code == 200, r.text          # still works, looked up (and cached) afresh
    refused_at: list[datetime] = []

    def refused() -> bool:
        r = ctx.call("GET", "/v1/models", k["key"])
        if r.status_code == 401:
            refused_at.append(datetime.now(UTC))
            return True
        assert r.status_code == 200, r.text
        return False

    ok, _ = poll(refused, timeout=8, every=0.2)
    assert ok, "an expired key still works"
    assert refused_at[0] >= expires - timedelta(milliseconds=300), "refused before it expired"
    # at once, not when a cached principal happens to age out
    assert refused_at[0] - expires < timedelta(seconds=1), refused_at[0] - expires
    for r in (ctx.call("GET", "/v1/models", k["key"]), ctx.chat(k["key"])):
        assert r.status_code == 401 and err(r)["code"] == "expired", r.text


def test_suspended_tenant(ctx):
    t, key = ctx.tenant()
    assert ctx.chat(key).status_code == 200
    r = ctx.srv.admin.patch(f"/tenants/{t['id']}", json={"status": "suspended"})
    assert r.status_code == 200 and r.json()["status"] == "suspended"
    ok, elapsed = poll(lambda: ctx.chat(key).status_code == 401)
    assert ok and elapsed < 5, elapsed
    assert elapsed < 0.5, f"the changing server itself took {elapsed:.2f}s (its key cache)"
    r = ctx.chat(key)
    assert err(r)["code"] == "tenant_suspended", r.text
    # a key made while suspended is refused too
    k2 = ctx.new_key(t["id"], name="while-suspended")
    assert err(ctx.call("GET", "/v1/models", k2["key"]))["code"] == "tenant_suspended"
    r = ctx.srv.admin.patch(f"/tenants/{t['id']}", json={"status": "active"})
    assert r.status_code == 200 and r.json()["status"] == "active"
    ok, elapsed = poll(lambda: ctx.chat(key).status_code == 200)
    assert ok and elapsed < 5, elapsed
    assert ctx.call("GET", "/v1/models", k2["key"]).status_code == 200


def test_deleted_tenant(ctx):
    admin = ctx.srv.admin
    t, key = ctx.tenant()
    for _ in range(2):
        assert ctx.chat(key).status_code == 200
    total_before = admin.get("/usage").json()["data"][0]["requests"]
    r = admin.delete(f"/tenants/{t['id']}")
    assert r.status_code == 200 and r.json() == {"id": t["id"], "object": "tenant", "deleted": True}
    r = ctx.chat(key)
    assert r.status_code == 401 and err(r)["code"] == "tenant_deleted", r.text
    assert ctx.call("GET", "/v1/usage", key).status_code == 401
    for method, path in (("GET", f"/tenants/{t['id']}"), ("GET", f"/tenants/{t['id']}/keys"),
                         ("PATCH", f"/tenants/{t['id']}"), ("DELETE", f"/tenants/{t['id']}"),
                         ("PUT", f"/tenants/{t['id']}/quota"), ("POST", f"/tenants/{t['id']}/keys")):
        body = {"PATCH": {"weight": 2}, "POST": {"name": "x"}, "PUT": {}}.get(method)
        r = admin.request(method, path, **({"json": body} if body is not None else {}))
        assert r.status_code == 404 and err(r)["code"] == "not_found", (method, path, r.text)
    assert t["id"] not in [x["id"] for x in admin.get("/tenants", params={"limit": 500}).json()["data"]]
    # its name is not reused
    assert admin.post("/tenants", json={"name": t["name"]}).status_code == 409
    # usage rows are kept: in the database, and in the all-tenant report
    n = db_query(ctx.srv, "SELECT COUNT(*) FROM usage_records WHERE tenant_id = ?", (t["id"],))[0][0]
    assert n == 2
    assert admin.get("/usage").json()["data"][0]["requests"] == total_before
    # per-tenant: a deleted tenant is not found (its rows still count in the totals above)
    r = admin.get("/usage", params={"tenant_id": t["id"]})
    if r.status_code == 200:
        assert r.json()["data"][0]["requests"] == 2, r.text
    else:
        assert r.status_code == 404 and err(r)["code"] == "not_found", r.text
    # the key rows are revoked, not removed
    rows = db_query(ctx.srv, "SELECT revoked_at FROM api_keys WHERE tenant_id = ?", (t["id"],))
    assert rows and all(rv is not None for (rv,) in rows)


# == 4. revocation, here and on a second replica ====================================================
def test_revocation_reaches_every_replica(ctx, tmp_path_factory):
    t, _ = ctx.tenant()
    k = ctx.new_key(t["id"], name="to-revoke")
    t2, key2 = ctx.tenant()
    replica = None
    try:
        if ctx.backend == "services":
            env = ctx.srv.env
            replica = GatewayServer.start(
                ctx.srv.data_dir / "replica", database_url=env["LOCKGATE_DATABASE_URL"],
                redis_url=env["LOCKGATE_REDIS_URL"], redis_prefix=env["LOCKGATE_REDIS_PREFIX"],
                pepper=env["LOCKGATE_PEPPER"], admin_key=ctx.srv.admin_key,
                models={"tiny": demo_model("llama", "tiny", 0),
                        "b-private": demo_model("llama", "tiny", 1)},
                private_models=("b-private",))
        servers = [ctx.srv] + ([replica] if replica else [])

        def status(srv: GatewayServer, key: str) -> httpx.Response:
            return httpx.get(srv.url + "/v1/models", timeout=30,
                             headers={"Authorization": f"Bearer {key}"})

        # warm: every server has the key cached
        for srv in servers:
            assert status(srv, k["key"]).status_code == 200
            assert status(srv, key2).status_code == 200
        r = ctx.srv.admin.delete(f"/keys/{k['id']}")
        assert r.status_code == 200 and r.json()["revoked"] is True
        times = {}
        for srv in servers:
            ok, elapsed = poll(lambda srv=srv: status(srv, k["key"]).status_code == 401)
            times[srv.url] = round(elapsed, 2)
            assert ok and elapsed < 5, f"revoked key still accepted by {srv.url} after {elapsed:.2f}s"
            assert err(status(srv, k["key"]))["code"] == "revoked"
        assert times[ctx.srv.url] < 0.5, times        # the revoking server forgets it at once
        got = ctx.srv.admin.get(f"/keys/{k['id']}").json()
        assert got["revoked_at"] is not None
        # revoking again changes nothing
        assert ctx.srv.admin.delete(f"/keys/{k['id']}").status_code == 200
        assert ctx.srv.admin.get(f"/keys/{k['id']}").json()["revoked_at"] == got["revoked_at"]

        if replica is not None:
            # the replica serves inference and the admin API off the same database
            assert httpx.get(replica.url + "/admin/v1/tenants/" + t2["id"], timeout=30,
                             headers={"Authorization": f"Bearer {ctx.srv.admin_key}"}).status_code == 200
            # a tenant suspended on one replica is refused by the other, then let back in
            r = ctx.srv.admin.patch(f"/tenants/{t2['id']}", json={"status": "suspended"})
            assert r.status_code == 200
            ok, elapsed = poll(lambda: status(replica, key2).status_code == 401)
            assert ok and elapsed < 5, elapsed
            assert err(status(replica, key2))["code"] == "tenant_suspended"
            r = ctx.srv.admin.patch(f"/tenants/{t2['id']}", json={"status": "active"})
            assert r.status_code == 200
            ok, elapsed = poll(lambda: status(replica, key2).status_code == 200)
            assert ok and elapsed < 5, elapsed
            # and a key revoked through the replica is refused by the first server
            k3 = ctx.new_key(t2["id"], name="via-replica")
            assert status(ctx.srv, k3["key"]).status_code == 200
            r = httpx.delete(f"{replica.url}/admin/v1/keys/{k3['id']}", timeout=30,
                             headers={"Authorization": f"Bearer {ctx.srv.admin_key}"})
            assert r.status_code == 200
            ok, elapsed = poll(lambda: status(ctx.srv, k3["key"]).status_code == 401)
            assert ok and elapsed < 5, elapsed
        print(f"revocation seen after (s): {times}")
    finally:
        if replica is not None:
            replica.stop()


# == 3. no key material at rest or in logs ==========================================================
def test_no_key_material_persists(ctx, tenants):
    srv = ctx.srv
    a, key_a, _, _ = tenants
    extra = ctx.new_key(a["id"], name="extra")
    # limited tenant and key: the limiter keeps state (in Redis on the services backend)
    limited, _ = ctx.tenant(quota={"requests_per_minute": 100, "daily_token_budget": 10**6})
    limited_key = ctx.new_key(limited["id"], name="limited",
                              quota={"tokens_per_minute": 10**5, "max_concurrent_requests": 4})
    r = ctx.chat(limited_key["key"])
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "100", r.text
    # exercise the request paths (and their logging) with every kind of key
    bad = "lg-" + secrets.token_urlsafe(32)
    bad_same_prefix = key_a[:15] + secrets.token_urlsafe(24)       # a real prefix, a wrong secret
    ctx.probed += [bad, bad_same_prefix]
    assert ctx.chat(extra["key"], header="x-api-key").status_code == 200
    assert ctx.chat(key_a).status_code == 200
    assert ctx.call("POST", "/v1/completions", key_a, json={"model": "tiny", "prompt": "x",
                                                            "max_tokens": 1}).status_code == 200
    for key in (bad, bad_same_prefix):
        for header in ("bearer", "x-api-key"):
            assert ctx.chat(key, header=header).status_code == 401
            assert ctx.call("GET", "/admin/v1/tenants", key, header=header).status_code == 401
    assert ctx.call("GET", "/admin/v1/engine", srv.admin_key, header="x-api-key").status_code == 200
    assert ctx.call("GET", "/v1/models", srv.admin_key).status_code == 403
    r = ctx.call("POST", "/v1/chat/completions", key_a, json={"model": "tiny", "messages": "oops"})
    assert r.status_code == 400
    assert ctx.srv.admin.delete(f"/keys/{extra['id']}").status_code == 200
    assert ctx.chat(extra["key"]).status_code == 401
    time.sleep(0.5)       # background last-used updates

    keys = list(dict.fromkeys(ctx.issued + ctx.probed))
    assert len(ctx.issued) >= 6, "too few keys issued for this test to mean much"

    # the database: every row of every table
    dump = db_dump(srv)
    assert {"tenants", "api_keys", "usage_records", "audit_entries"} <= set(dump), sorted(dump)
    text = "\n".join(f"{t}: {row!r}" for t, rows in dump.items() for row in rows)
    leaks = find_leaks(text, keys)
    assert not leaks, f"key material in the database: {leaks[:5]}"
    # ... which stores a peppered HMAC per key, and its lookup prefix in clear
    if ctx.backend == "embedded":
        pepper = keymod.load_or_create_pepper(srv.data_dir)
        assert stat.S_IMODE(os.stat(srv.data_dir / "pepper").st_mode) == 0o600
    else:
        pepper = keymod.pepper_from_setting(srv.env["LOCKGATE_PEPPER"])
    stored = {p: h for p, h in db_query(srv, "SELECT prefix, secret_hash FROM api_keys")}
    for key in ctx.issued:
        prefix = keymod.lookup_prefix(key)
        assert stored.get(prefix) == keymod.hash_secret(key, pepper), prefix

    # Redis (services): the limiter's state names ids, never keys
    if ctx.backend == "services":
        import redis

        client = redis.Redis.from_url(srv.env["LOCKGATE_REDIS_URL"])
        try:
            chunks = []
            for name in client.scan_iter(match=srv.env["LOCKGATE_REDIS_PREFIX"] + "*", count=1000):
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

    # the logs (INFO level: `lockgate -v serve`), and every file under the data directory
    log = srv.log()
    assert re.search(r" INFO [\w.]+: ", log), "the server did not log at INFO level:\n" + log[-2000:]
    leaks = find_leaks(log, keys)
    assert not leaks, f"key material in the server log: {leaks[:5]}"
    files = sorted(p for p in Path(srv.data_dir).rglob("*") if p.is_file())
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
        assert ctx.call("GET", "/v1/models", demo_keys[0]).status_code == 200
