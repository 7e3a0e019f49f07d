"""tenancy: models, service functions, keys and the usage writer, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import stat
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import IntegrityError

from lockgate.tenancy import api_keys, audit, keys, tenants
from lockgate.tenancy import db as tdb
from lockgate.tenancy.auth import Principal, authenticate
from lockgate.tenancy.errors import AuthError, Conflict, Invalid, NotFound
from lockgate.tenancy.models import ApiKey, AuditEntry, Base, Tenant, UsageRecord
from lockgate.tenancy.quota import Quota
from lockgate.tenancy.usage.report import usage_report
from lockgate.tenancy.usage.writer import UsageRow, UsageWriter

PEPPER = bytes(range(32))
ACTOR = "key_0000000000000000"


async def count(sessions, model, *where) -> int:
    async with sessions() as s:
        return await s.scalar(select(func.count()).select_from(model).where(*where))


async def new_tenant(sessions, name="acme", **kw) -> Tenant:
    async with sessions() as s:
        return await tenants.create_tenant(s, name=name, actor=ACTOR, **kw)


async def new_key(sessions, tenant_id, **kw) -> tuple[ApiKey, str]:
    kw.setdefault("name", "k")
    async with sessions() as s:
        return await api_keys.create_key(s, tenant_id=tenant_id, pepper=PEPPER, actor=ACTOR, **kw)


async def auth(sessions, plaintext, pepper=PEPPER) -> Principal:
    async with sessions() as s:
        return await authenticate(s, plaintext, pepper)


async def auth_reason(sessions, plaintext, pepper=PEPPER) -> str:
    with pytest.raises(AuthError) as info:
        await auth(sessions, plaintext, pepper)
    return info.value.reason


def usage(request_id, tenant_id, key_id="key_x", *, model="m1", tier="default", prompt=10,
          cached=0, completion=5, status="ok", ttft=12.5, created_at=None) -> UsageRow:
    return UsageRow(request_id, tenant_id, key_id, model, tier, prompt, cached, completion,
                    status, 1.0, ttft, 40.0, created_at)


# -- pure helpers ------------------------------------------------------------------------------


def test_generate_hash_verify():
    plaintext, prefix = keys.generate_key()
    assert plaintext.startswith("lg-") and len(plaintext) == 3 + 43
    assert prefix == plaintext[3:15] and len(prefix) == 12
    assert keys.generate_key()[0] != plaintext
    digest = keys.hash_secret(plaintext, PEPPER)
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert keys.verify(plaintext, digest, PEPPER)
    assert not keys.verify(plaintext + "x", digest, PEPPER)
    assert not keys.verify(plaintext, digest, b"another pepper")
    assert keys.hash_secret(plaintext, b"another pepper") != digest


def test_pepper_file(tmp_path):
    d = tmp_path / "data"
    first = keys.load_or_create_pepper(d)
    assert len(first) == 32
    path = d / "pepper"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert bytes.fromhex(path.read_text().strip()) == first
    assert keys.load_or_create_pepper(d) == first          # read, not recreated
    assert keys.load_or_create_pepper(tmp_path / "other") != first
    path.write_text("abcd\n")
    with pytest.raises(Invalid) as info:
        keys.load_or_create_pepper(d)
    assert info.value.field == "pepper"


def test_pepper_from_setting():
    assert keys.pepper_from_setting("ab" * 32) == bytes([0xAB]) * 32
    raw = "a long pass phrase, not hex, 32+ bytes"
    assert keys.pepper_from_setting(raw) == raw.encode()
    for bad in ("", "   ", "abcd", "short phrase"):
        with pytest.raises(Invalid) as info:
            keys.pepper_from_setting(bad)
        assert info.value.field == "pepper"


def test_errors():
    assert AuthError("revoked").reason == "revoked"
    with pytest.raises(ValueError):
        AuthError("nope")
    e = Invalid("weight", "must be > 0")
    assert e.field == "weight" and "weight" in str(e) and isinstance(e, ValueError)
    assert Conflict("name", "taken").field == "name"
    assert "tenant 'ten_1' not found" in str(NotFound("tenant", "ten_1"))


def test_url_normalisation():
    assert tdb.async_url("sqlite:///x.db") == "sqlite+aiosqlite:///x.db"
    assert tdb.async_url("sqlite+aiosqlite:///x.db") == "sqlite+aiosqlite:///x.db"
    assert tdb.async_url("postgres://u:p%40w@h:5/d") == "postgresql+asyncpg://u:p%40w@h:5/d"
    assert tdb.async_url("postgresql://u@h/d") == "postgresql+asyncpg://u@h/d"
    assert tdb.async_url("postgresql+psycopg2://u@h/d") == "postgresql+asyncpg://u@h/d"
    assert tdb.sync_url("postgresql+asyncpg://u@h/d") == "postgresql+psycopg://u@h/d"
    assert tdb.sync_url("sqlite+aiosqlite:///x.db") == "sqlite:///x.db"
    for bad in ("", "mysql://u@h/d", "not a url"):
        with pytest.raises(Invalid) as info:
            tdb.async_url(bad)
        assert info.value.field == "database_url"


def test_usage_row_validation():
    usage("r", "ten_1")  # valid
    cases = {
        "status": dict(status="done"),
        "service_tier": dict(tier="gold"),
        "prompt_tokens": dict(prompt=-1),
        "cached_tokens": dict(cached=-3),
        "ttft_ms": dict(ttft=float("nan")),
        "request_id": dict(request_id=""),
    }
    for field, kw in cases.items():
        rid = kw.pop("request_id", "r")
        with pytest.raises(Invalid) as info:
            usage(rid, "ten_1", **kw)
        assert info.value.field == field


# -- database ----------------------------------------------------------------------------------


async def test_engine_settings_and_ping(db_url, sessions):
    async with sessions() as s:
        await tdb.ping(s)
        if s.bind.dialect.name == "sqlite":
            assert (await s.execute(text("PRAGMA foreign_keys"))).scalar() == 1
            assert (await s.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
        else:
            assert s.bind.dialect.driver == "asyncpg"


async def test_tenant_crud(sessions):
    t = await new_tenant(sessions, "acme")
    assert t.id.startswith("ten_") and len(t.id) == 20 and int(t.id[4:], 16) >= 0
    assert (t.status, t.weight, t.default_tier, t.models) == ("active", 1.0, "default", None)
    assert t.service_tiers == ["default", "flex"]      # the default plan: priority is granted
    assert tenants.tenant_quota(t) == Quota()
    assert t.created_at.tzinfo is not None and t.deleted_at is None

    b = await new_tenant(sessions, "beta", weight=2.5, service_tiers=["flex", "priority"],
                         default_tier="priority", models=["m1", "m1", "lora-a"],
                         quota=Quota(requests_per_minute=60, monthly_token_budget=10**10))
    async with sessions() as s:
        got = await tenants.get_tenant(s, b.id)
        assert got.weight == 2.5
        assert got.service_tiers == ["priority", "flex"]       # canonical order
        assert got.default_tier == "priority"
        assert got.models == ["m1", "lora-a"]
        assert tenants.tenant_quota(got) == Quota(requests_per_minute=60,
                                                  monthly_token_budget=10**10)
        assert got.created_at.tzinfo == UTC

    async with sessions() as s:
        u = await tenants.update_tenant(s, t.id, actor=ACTOR, name="acme2", weight=3,
                                        models=["m2"], status="suspended")
        assert (u.name, u.weight, u.models, u.status) == ("acme2", 3.0, ["m2"], "suspended")
        assert u.updated_at >= u.created_at
    async with sessions() as s:
        u = await tenants.update_tenant(s, t.id, actor=ACTOR, models=None)
    async with sessions() as s:
        got = await tenants.get_tenant(s, t.id)
        assert (got.name, got.weight, got.models, got.status) == ("acme2", 3.0, None, "suspended")
        await tenants.set_quota(s, t.id, Quota(tokens_per_minute=1000), actor=ACTOR)
    async with sessions() as s:
        assert tenants.tenant_quota(await tenants.get_tenant(s, t.id)) == \
            Quota(tokens_per_minute=1000)

    # cursor pagination by id
    for i in range(5):
        await new_tenant(sessions, f"t{i}")
    async with sessions() as s:
        everything = await tenants.list_tenants(s, limit=100)
        assert len(everything) == 7
        ids = [x.id for x in everything]
        assert ids == sorted(ids)
        pages, after = [], None
        while page := await tenants.list_tenants(s, limit=3, after=after):
            pages.append([x.id for x in page])
            after = page[-1].id
        assert [len(p) for p in pages] == [3, 3, 1]
        assert [i for page in pages for i in page] == ids
        with pytest.raises(Invalid) as info:
            await tenants.list_tenants(s, limit=0)
        assert info.value.field == "limit"
        with pytest.raises(NotFound):
            await tenants.get_tenant(s, "ten_doesnotexist00")

    async with sessions() as s:
        actions = [a.action for a in reversed(await audit.list_audit(s))]
    assert actions == ["tenant.create", "tenant.create", "tenant.update", "tenant.update",
                       "tenant.set_quota"] + ["tenant.create"] * 5


async def test_duplicate_names_conflict(sessions):
    t = await new_tenant(sessions, "acme")
    other = await new_tenant(sessions, "other")
    with pytest.raises(Conflict) as info:
        await new_tenant(sessions, "acme")
    assert info.value.field == "name"
    async with sessions() as s:
        with pytest.raises(Conflict) as info:
            await tenants.update_tenant(s, other.id, actor=ACTOR, name="acme")
        assert info.value.field == "name"
    async with sessions() as s:
        await tenants.delete_tenant(s, t.id, actor=ACTOR)
    with pytest.raises(Conflict, match="deleted"):       # names of deleted tenants stay taken
        await new_tenant(sessions, "acme")
    assert await count(sessions, Tenant) == 2
    assert await count(sessions, AuditEntry) == 3
    async with sessions() as s:
        assert (await tenants.get_tenant(s, other.id)).name == "other"


async def test_unique_violation_from_the_database_rolls_back(sessions, monkeypatch):
    """When the pre-check misses a concurrent insert, the database's unique constraint still
    yields Conflict, and the audit entry of the failed operation is gone with it."""
    await new_tenant(sessions, "acme")

    async def no_check(*args, **kwargs):
        return None

    monkeypatch.setattr(tenants, "_name_taken", no_check)
    with pytest.raises(Conflict) as info:
        await new_tenant(sessions, "acme")
    assert info.value.field == "name"
    assert await count(sessions, Tenant) == 1
    assert await count(sessions, AuditEntry) == 1


CREATE_CASES = [
    ("name", dict(name="")),
    ("name", dict(name="-leading-dash")),
    ("name", dict(name="has space")),
    ("name", dict(name="x" * 65)),
    ("name", dict(name=42)),
    ("weight", dict(weight=0)),
    ("weight", dict(weight=-1.0)),
    ("weight", dict(weight=float("nan"))),
    ("weight", dict(weight="2")),
    ("weight", dict(weight=True)),
    ("status", dict(status="deleted")),
    ("service_tiers", dict(service_tiers=["gold"])),
    ("service_tiers", dict(service_tiers=[])),
    ("service_tiers", dict(service_tiers="default")),
    ("default_tier", dict(service_tiers=["flex"])),
    ("default_tier", dict(service_tiers=["default"], default_tier="flex")),
    ("default_tier", dict(default_tier="gold")),
    ("models", dict(models=[1])),
    ("models", dict(models=[""])),
    ("models", dict(models="m1")),
    ("quota", dict(quota={"requests_per_second": 1})),
    ("quota", dict(quota={"tokens_per_minute": -5})),
    ("quota", dict(quota=5)),
    ("actor", dict(actor="")),
]


async def test_invalid_tenant_input_names_field_and_changes_nothing(sessions):
    for field, kw in CREATE_CASES:
        kw = {"name": "ok-name", "actor": ACTOR, **kw}
        async with sessions() as s:
            with pytest.raises(Invalid) as info:
                await tenants.create_tenant(s, **kw)
        assert info.value.field == field, (kw, info.value)
        assert field in str(info.value)
    assert await count(sessions, Tenant) == 0
    assert await count(sessions, AuditEntry) == 0

    t = await new_tenant(sessions, "acme", service_tiers=["default", "flex"])
    update_cases = [
        ("id", dict(id="ten_x")),
        ("created_at", dict(created_at=datetime.now(UTC))),
        ("requests_per_minute", dict(requests_per_minute=1)),
        ("weight", dict(weight=-2)),
        ("name", dict(name="bad name")),
        ("status", dict(status="gone")),
        ("service_tiers", dict(service_tiers=["priority"])),         # drops the default tier
        ("default_tier", dict(default_tier="priority")),               # not an allowed tier
        ("default_tier", dict(service_tiers=["priority"], default_tier="flex")),
        ("models", dict(models=[None])),
    ]
    for field, kw in update_cases:
        async with sessions() as s:
            with pytest.raises(Invalid) as info:
                await tenants.update_tenant(s, t.id, actor=ACTOR, **{"weight": 9, **kw})
        assert info.value.field == field, (kw, info.value)
    async with sessions() as s:
        with pytest.raises(Invalid) as info:
            await tenants.set_quota(s, t.id, {"daily_token_budget": "lots"}, actor=ACTOR)
        assert info.value.field == "quota"
    async with sessions() as s:
        got = await tenants.get_tenant(s, t.id)
        assert (got.name, got.weight, got.status, got.service_tiers, got.default_tier) == \
            ("acme", 1.0, "active", ["default", "flex"], "default")
        assert tenants.tenant_quota(got) == Quota()
        # a valid combination: change tiers and default together
        got = await tenants.update_tenant(s, t.id, actor=ACTOR, service_tiers=["priority"],
                                          default_tier="priority")
        assert (got.service_tiers, got.default_tier) == (["priority"], "priority")
    assert await count(sessions, AuditEntry) == 2


async def test_soft_delete_keeps_usage_and_revokes_keys(sessions):
    t = await new_tenant(sessions, "acme")
    keep = await new_tenant(sessions, "keep")
    (k1, p1), (k2, _) = await new_key(sessions, t.id), await new_key(sessions, t.id, name="k2")
    _, p_keep = await new_key(sessions, keep.id)
    async with sessions() as s:
        await api_keys.revoke_key(s, k2.id, actor=ACTOR)
    async with UsageWriter(sessions) as w:
        await asyncio.gather(*(w.record(usage(f"r{i}", t.id, k1.id)) for i in range(3)))

    async with sessions() as s:
        deleted = await tenants.delete_tenant(s, t.id, actor=ACTOR)
        assert deleted.deleted_at is not None
    async with sessions() as s:
        with pytest.raises(NotFound):
            await tenants.get_tenant(s, t.id)
        with pytest.raises(NotFound):
            await tenants.update_tenant(s, t.id, actor=ACTOR, weight=2)
        with pytest.raises(NotFound):
            await tenants.delete_tenant(s, t.id, actor=ACTOR)
        with pytest.raises(NotFound):
            await tenants.set_quota(s, t.id, Quota(), actor=ACTOR)
        assert [x.id for x in await tenants.list_tenants(s)] == [keep.id]
        row = await s.get(Tenant, t.id)           # the row itself remains
        assert row is not None and row.deleted_at is not None
        revoked = (await s.scalars(select(ApiKey).where(ApiKey.tenant_id == t.id))).all()
        assert len(revoked) == 2 and all(k.revoked_at is not None for k in revoked)
    with pytest.raises(NotFound):
        await new_key(sessions, t.id)
    assert await count(sessions, UsageRecord, UsageRecord.tenant_id == t.id) == 3
    assert await auth_reason(sessions, p1) == "tenant_deleted"
    assert (await auth(sessions, p_keep)).tenant_id == keep.id
    async with sessions() as s:
        report = await usage_report(s, tenant_id=t.id, start=None, end=None,
                                    group_by=None)
        assert report[0]["requests"] == 3
        delete_audit = (await audit.list_audit(s, limit=1))[0]
        assert (delete_audit.action, delete_audit.target_id) == ("tenant.delete", t.id)
        assert delete_audit.detail["revoked_keys"] == 1      # k2 was revoked before


async def test_keys_and_authentication(sessions):
    t = await new_tenant(sessions, "acme", weight=2.0, service_tiers=["default", "flex"],
                         models=["m1"], quota=Quota(tokens_per_minute=500))
    expires = datetime.now(UTC) + timedelta(days=30)
    key, plaintext = await new_key(sessions, t.id, name="ci", expires_at=expires,
                                   quota=Quota(requests_per_minute=7))
    assert key.id.startswith("key_") and len(key.id) == 20
    assert plaintext.startswith("lg-") and key.prefix == plaintext[3:15]
    assert key.secret_hash == keys.hash_secret(plaintext, PEPPER)
    assert key.scopes == ["inference"] and key.tenant_id == t.id

    p = await auth(sessions, plaintext)
    assert (p.key_id, p.key_name, p.tenant_id, p.tenant_name) == (key.id, "ci", t.id, "acme")
    assert p.scopes == frozenset({"inference"}) and not p.is_admin
    assert (p.weight, p.service_tiers, p.default_tier, p.models) == \
        (2.0, ("default", "flex"), "default", ("m1",))
    assert p.tenant_quota == Quota(tokens_per_minute=500)
    assert p.key_quota == Quota(requests_per_minute=7)
    assert abs((p.expires_at - expires).total_seconds()) < 1e-3 and p.expires_at.tzinfo
    assert hash(p) == hash(dataclasses.replace(p))         # frozen and hashable: cacheable
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.weight = 3.0  # type: ignore[misc]

    admin, admin_plain = await new_key(sessions, None, name="ops", scopes=["admin"])
    ap = await auth(sessions, admin_plain)
    assert ap.is_admin and ap.tenant_id is None and ap.tenant_name is None
    assert ap.scopes == frozenset({"admin"})
    assert ap.service_tiers == ()                           # no tenant, no plan

    async with sessions() as s:
        assert [k.id for k in await api_keys.list_keys(s, t.id)] == [key.id]
        assert [k.id for k in await api_keys.list_keys(s, None)] == [admin.id]
        assert (await api_keys.get_key(s, key.id)).name == "ci"
        with pytest.raises(NotFound):
            await api_keys.get_key(s, "key_0123456789abcdef")
        with pytest.raises(NotFound):
            await api_keys.list_keys(s, "ten_0123456789abcdef")
        k = await api_keys.set_key_quota(s, key.id, Quota(max_concurrent_requests=2), actor=ACTOR)
        assert api_keys.key_quota(k) == Quota(max_concurrent_requests=2)
    assert (await auth(sessions, plaintext)).key_quota == Quota(max_concurrent_requests=2)


async def test_invalid_key_input_changes_nothing(sessions):
    t = await new_tenant(sessions, "acme")
    past = datetime.now(UTC) - timedelta(seconds=1)
    cases = [
        ("scopes", dict(tenant_id=t.id, scopes=["admin"])),
        ("scopes", dict(tenant_id=t.id, scopes=["inference", "admin"])),
        ("scopes", dict(tenant_id=t.id, scopes=["root"])),
        ("scopes", dict(tenant_id=t.id, scopes=[])),
        ("tenant_id", dict(tenant_id=None, scopes=["inference"])),
        ("tenant_id", dict(tenant_id=None, scopes=["inference", "admin"])),
        ("expires_at", dict(tenant_id=t.id, expires_at=past)),
        ("expires_at", dict(tenant_id=t.id, expires_at="tomorrow")),
        ("name", dict(tenant_id=t.id, name="")),
        ("name", dict(tenant_id=t.id, name="x" * 65)),
        ("quota", dict(tenant_id=t.id, quota={"nope": 1})),
        ("pepper", dict(tenant_id=t.id, pepper=b"")),
    ]
    for field, kw in cases:
        kw = {"name": "k", "pepper": PEPPER, "actor": ACTOR, **kw}
        async with sessions() as s:
            with pytest.raises(Invalid) as info:
                await api_keys.create_key(s, **kw)
        assert info.value.field == field, (kw, info.value)
    with pytest.raises(NotFound):
        await new_key(sessions, "ten_0123456789abcdef")
    assert await count(sessions, ApiKey) == 0
    assert await count(sessions, AuditEntry) == 1      # the tenant's creation only


async def test_authentication_failures(sessions):
    t = await new_tenant(sessions, "acme")
    key, plaintext = await new_key(sessions, t.id)
    assert (await auth(sessions, plaintext)).key_id == key.id

    assert await auth_reason(sessions, "") == "missing"
    assert await auth_reason(sessions, None) == "missing"
    assert await auth_reason(sessions, "not-a-key") == "invalid"
    assert await auth_reason(sessions, "lg-short") == "invalid"
    assert await auth_reason(sessions, plaintext + " ") == "invalid"
    assert await auth_reason(sessions, keys.generate_key()[0]) == "invalid"      # unknown
    tampered = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")
    assert await auth_reason(sessions, tampered) == "invalid"                    # same prefix
    assert await auth_reason(sessions, plaintext, pepper=b"x" * 32) == "invalid"

    async with sessions() as s:
        await tenants.update_tenant(s, t.id, actor=ACTOR, status="suspended")
    assert await auth_reason(sessions, plaintext) == "tenant_suspended"
    async with sessions() as s:
        await tenants.update_tenant(s, t.id, actor=ACTOR, status="active")
    assert (await auth(sessions, plaintext)).key_id == key.id

    expiring, exp_plain = await new_key(sessions, t.id, name="exp",
                                        expires_at=datetime.now(UTC) + timedelta(hours=1))
    assert (await auth(sessions, exp_plain)).key_id == expiring.id
    async with sessions() as s:
        await s.execute(update(ApiKey).where(ApiKey.id == expiring.id)
                        .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        await s.commit()
    assert await auth_reason(sessions, exp_plain) == "expired"

    async with sessions() as s:
        revoked = await api_keys.revoke_key(s, key.id, actor=ACTOR)
        first = revoked.revoked_at
        assert first is not None
        again = await api_keys.revoke_key(s, key.id, actor=ACTOR)       # idempotent
        assert again.revoked_at == first
        with pytest.raises(NotFound):
            await api_keys.revoke_key(s, "key_0123456789abcdef", actor=ACTOR)
    assert await auth_reason(sessions, plaintext) == "revoked"
    async with sessions() as s:
        revokes = [a for a in await audit.list_audit(s) if a.action == "key.revoke"]
        assert len(revokes) == 1


async def test_no_plaintext_key_in_database(sessions):
    t = await new_tenant(sessions, "acme")
    secrets_ = [await new_key(sessions, t.id, name=f"k{i}") for i in range(3)]
    _, admin_plain = await new_key(sessions, None, scopes=["admin"])
    bootstrap = "lg-" + "B00tstrap-admin-key-0123456789abcdefXYZ"
    async with sessions() as s:
        assert await api_keys.ensure_admin_key(s, bootstrap, PEPPER)
    plaintexts = [p for _, p in secrets_] + [admin_plain, bootstrap]

    dump = []
    async with sessions() as s:
        for table in Base.metadata.sorted_tables:
            for row in (await s.execute(table.select())).all():
                dump.append(json.dumps([str(v) for v in row]))
    blob = "\n".join(dump)
    for p in plaintexts:
        assert p[3:15] in blob                     # the lookup prefix is stored (dump works)
        assert p not in blob
        assert p[15:] not in blob                  # the secret part
        assert p[15:35] not in blob


async def test_bootstrap_admin_key(sessions):
    plaintext = "lg-" + "x" * 12 + "-operator-chosen-secret-0123456789"
    async with sessions() as s:
        assert not await api_keys.has_admin_key(s)
        assert await api_keys.ensure_admin_key(s, plaintext, PEPPER) is True
    async with sessions() as s:
        assert await api_keys.ensure_admin_key(s, plaintext, PEPPER) is False
        assert await api_keys.has_admin_key(s)
    p = await auth(sessions, plaintext)
    assert p.is_admin and p.key_name == "bootstrap" and p.tenant_id is None
    assert await count(sessions, ApiKey) == 1

    async with sessions() as s:
        with pytest.raises(Conflict) as info:    # same lookup prefix, another secret
            other = "lg-" + "x" * 12 + "-a-different-secret-000000000"
            await api_keys.ensure_admin_key(s, other, PEPPER)
        assert info.value.field == "admin_key"
        for bad in ("", "lg-short", "no-prefix-" + "y" * 40, "lg-" + "y" * 20):
            with pytest.raises(Invalid) as info:
                await api_keys.ensure_admin_key(s, bad, PEPPER)
            assert info.value.field == "admin_key"
        await api_keys.revoke_key(s, p.key_id, actor=p.key_id)
    async with sessions() as s:
        assert not await api_keys.has_admin_key(s)
        assert await api_keys.ensure_admin_key(s, plaintext, PEPPER) is False   # stays revoked
    assert await auth_reason(sessions, plaintext) == "revoked"
    async with sessions() as s:
        actions = [(a.actor, a.action) for a in reversed(await audit.list_audit(s))]
    assert actions == [("bootstrap", "key.bootstrap"), (p.key_id, "key.revoke")]


async def test_touch_key(sessions):
    t = await new_tenant(sessions, "acme")
    key, _ = await new_key(sessions, t.id)
    assert key.last_used_at is None
    t1 = datetime(2030, 1, 1, 12, tzinfo=UTC)
    eastern = timezone(timedelta(hours=-5))
    for when in (t1, t1 - timedelta(minutes=5), datetime(2030, 1, 1, 8, tzinfo=eastern)):
        async with sessions() as s:
            await api_keys.touch_key(s, key.id, when)
    async with sessions() as s:
        got = await api_keys.get_key(s, key.id)
        assert got.last_used_at == datetime(2030, 1, 1, 13, tzinfo=UTC)
    assert await count(sessions, AuditEntry) == 2       # tenant + key creation only


async def test_usage_writer_group_commit(sessions):
    t = await new_tenant(sessions, "acme")
    key, _ = await new_key(sessions, t.id)
    n = 600
    writer = UsageWriter(sessions, max_batch=128, max_delay_s=0.005)
    with pytest.raises(RuntimeError):
        await writer.record(usage("early", t.id, key.id))
    await writer.start()
    results = await asyncio.gather(*(writer.record(usage(f"req-{i}", t.id, key.id, prompt=i))
                                     for i in range(n)))
    assert results == [None] * n
    assert writer.rows == n
    assert 1 < writer.largest_batch <= 128
    assert writer.batches < n / 4
    async with sessions() as s:
        rows = (await s.execute(select(UsageRecord.request_id, UsageRecord.prompt_tokens))).all()
    assert sorted(rows) == sorted((f"req-{i}", i) for i in range(n))

    # A bad row fails alone; the rest of its batch is committed.
    batch = [usage(f"b-{i}", t.id, key.id) for i in range(10)]
    batch[3] = usage("req-7", t.id, key.id)                       # request_id taken
    batch[6] = usage("b-orphan", "ten_0123456789abcdef", key.id)  # no such tenant
    out = await asyncio.gather(*(writer.record(r) for r in batch), return_exceptions=True)
    assert [type(o) for o in out].count(type(None)) == 8
    assert isinstance(out[3], IntegrityError) and isinstance(out[6], IntegrityError)
    assert await count(sessions, UsageRecord) == n + 8

    # close() writes what is queued, then refuses new rows.
    pending = [asyncio.ensure_future(writer.record(usage(f"late-{i}", t.id, key.id)))
               for i in range(20)]
    await asyncio.sleep(0)
    await writer.close()
    await asyncio.gather(*pending)
    assert await count(sessions, UsageRecord) == n + 28
    with pytest.raises(RuntimeError):
        await writer.record(usage("after-close", t.id, key.id))
    with pytest.raises(Invalid):
        UsageWriter(sessions, max_batch=0)


async def test_usage_writer_cancelled_fails_waiters(sessions):
    t = await new_tenant(sessions, "acme")
    writer = UsageWriter(sessions, max_delay_s=5.0)      # would sit on the batch for 5 s
    await writer.start()
    waiting = asyncio.ensure_future(writer.record(usage("r1", t.id)))
    await asyncio.sleep(0.05)
    writer._task.cancel()
    with pytest.raises(RuntimeError, match="stopped"):
        await asyncio.wait_for(waiting, 2)
    await writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        await writer.record(usage("r2", t.id))
    assert await count(sessions, UsageRecord) == 0


async def test_usage_writer_reports_commit_failure(db_url):
    engine = tdb.make_engine(db_url)          # schema never created: every insert fails
    try:
        async with UsageWriter(tdb.make_sessionmaker(engine)) as writer:
            out = await asyncio.gather(*(writer.record(usage(f"r{i}", "ten_x")) for i in range(5)),
                                       return_exceptions=True)
        assert all(isinstance(o, Exception) for o in out)
        assert writer.rows == 0
    finally:
        await engine.dispose()


async def test_usage_report(sessions):
    a = await new_tenant(sessions, "a")
    b = await new_tenant(sessions, "b")
    d1 = datetime(2024, 3, 1, 10, 0, tzinfo=UTC)
    d2 = datetime(2024, 3, 2, 9, 0, tzinfo=UTC)
    late_local = datetime(2024, 3, 1, 23, 30, tzinfo=timezone(timedelta(hours=-5)))  # 3-2 UTC
    rows = []
    # tenant a, day 1: ten ok requests on m1/default, ttft 10..100
    for i in range(10):
        rows.append(usage(f"a1-{i}", a.id, model="m1", prompt=100, cached=20, completion=10,
                          ttft=10.0 * (i + 1), created_at=d1 + timedelta(minutes=i)))
    # tenant a, day 2: m2/priority: an error (no ttft), a cancelled one, and a late one
    rows.append(usage("a2-err", a.id, model="m2", tier="priority", prompt=7, completion=0,
                      status="error", ttft=None, created_at=d2))
    rows.append(usage("a2-can", a.id, model="m2", tier="priority", prompt=3, completion=1,
                      status="cancelled", ttft=5.0, created_at=d2 + timedelta(hours=1)))
    rows.append(usage("a2-late", a.id, model="m1", tier="flex", prompt=1, completion=1,
                      ttft=1000.0, created_at=late_local))
    # tenant b
    rows.append(usage("b1", b.id, model="m1", prompt=50, completion=50, ttft=3.0,
                      created_at=d1))
    async with UsageWriter(sessions) as w:
        await asyncio.gather(*(w.record(r) for r in rows))

    async def report(**kw):
        kw.setdefault("tenant_id", a.id)
        kw.setdefault("start", None)
        kw.setdefault("end", None)
        kw.setdefault("group_by", None)
        async with sessions() as s:
            return await usage_report(s, **kw)

    [total] = await report()
    assert total == {
        "group": None, "requests": 13, "ok": 11, "errors": 1, "cancelled": 1,
        "prompt_tokens": 1011, "cached_tokens": 200, "completion_tokens": 102,
        "total_tokens": 1113, "budget_tokens": 1113,    # rows without a price: prompt + completion
        # ttfts: 5, 10..100, 1000 (12 values): rank ceil(6)=6 -> 50; ceil(11.4)=12 -> 1000
        "ttft_ms_p50": 50.0, "ttft_ms_p95": 1000.0,
    }

    days = await report(group_by="day")
    assert [d["group"] for d in days] == ["2024-03-01", "2024-03-02"]
    assert [d["requests"] for d in days] == [10, 3]
    assert (days[0]["ttft_ms_p50"], days[0]["ttft_ms_p95"]) == (50.0, 100.0)
    assert (days[1]["ttft_ms_p50"], days[1]["ttft_ms_p95"]) == (5.0, 1000.0)
    assert days[1]["errors"] == 1 and days[1]["cancelled"] == 1 and days[1]["ok"] == 1

    models = {m["group"]: m for m in await report(group_by="model")}
    assert set(models) == {"m1", "m2"}
    assert models["m1"]["requests"] == 11 and models["m1"]["prompt_tokens"] == 1001
    assert (models["m2"]["ttft_ms_p50"], models["m2"]["ttft_ms_p95"]) == (5.0, 5.0)

    tiers = {x["group"]: x["requests"] for x in await report(group_by="service_tier")}
    assert tiers == {"default": 10, "priority": 2, "flex": 1}

    # all tenants, and a [start, end) window
    [everyone] = await report(tenant_id=None)
    assert everyone["requests"] == 14 and everyone["total_tokens"] == 1213
    [window] = await report(start=d1 + timedelta(minutes=2), end=d1 + timedelta(minutes=5))
    assert window["requests"] == 3 and window["ttft_ms_p50"] == 40.0
    [naive] = await report(start=datetime(2024, 3, 2), end=None)      # naive means UTC
    assert naive["requests"] == 3

    # nothing matches: one all-zero total, no groups
    [empty] = await report(tenant_id="ten_0123456789abcdef")
    assert empty["requests"] == 0 and empty["total_tokens"] == 0
    assert empty["ttft_ms_p50"] is None and empty["ttft_ms_p95"] is None
    assert await report(tenant_id="ten_0123456789abcdef", group_by="day") == []

    for kw, field in ((dict(group_by="week"), "group_by"),
                      (dict(start=d2, end=d1), "end"),
                      (dict(start="yesterday"), "start")):
        with pytest.raises(Invalid) as info:
            await report(**kw)
        assert info.value.field == field


async def test_list_audit(sessions):
    t = await new_tenant(sessions, "acme")
    async with sessions() as s:
        await tenants.update_tenant(s, t.id, actor="key_aaaaaaaaaaaaaaaa", weight=4)
    key, _ = await new_key(sessions, t.id)
    async with sessions() as s:
        entries = await audit.list_audit(s)
        assert [(e.action, e.target_type, e.target_id) for e in entries] == [
            ("key.create", "key", key.id),
            ("tenant.update", "tenant", t.id),
            ("tenant.create", "tenant", t.id),
        ]
        assert entries[1].actor == "key_aaaaaaaaaaaaaaaa"
        assert entries[1].detail == {"before": {"weight": 1.0}, "after": {"weight": 4.0}}
        assert entries[0].created_at.tzinfo == UTC
        assert len(await audit.list_audit(s, limit=2)) == 2
        with pytest.raises(Invalid) as info:
            await audit.list_audit(s, limit=-1)
        assert info.value.field == "limit"


async def test_a_viewer_key_is_no_admin_key_and_its_console_sessions_end_with_it(sessions):
    """A database whose only admin-side key is a viewer key has no admin key (the server makes
    one at start); revoking a key deletes its console sessions."""
    from lockgate.tenancy import console_sessions

    async with sessions() as s:
        viewer, _ = await api_keys.create_key(s, tenant_id=None, name="v", scopes=("viewer",), pepper=PEPPER,
                                              actor="test")
        assert not await api_keys.has_admin_key(s)
        token = await console_sessions.open_session(s, key_id=viewer.id, ttl_s=60, client="127.0.0.1")
        assert await console_sessions.session_key_id(s, token) == viewer.id
        await api_keys.revoke_key(s, viewer.id, actor="test")
        assert await console_sessions.session_key_id(s, token) is None
        admin, _ = await api_keys.create_key(s, tenant_id=None, name="a", scopes=("admin",), pepper=PEPPER,
                                             actor="test")
        assert await api_keys.has_admin_key(s)
        expired = await console_sessions.open_session(s, key_id=admin.id, ttl_s=0.001, client="127.0.0.1")
        await asyncio.sleep(0.01)
        assert await console_sessions.session_key_id(s, expired) is None
