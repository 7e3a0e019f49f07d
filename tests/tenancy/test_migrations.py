"""Migrations: `upgrade head` builds exactly the models' schema on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from lockgate.tenancy import db as tdb
from lockgate.tenancy.models import Base

TABLES = {"tenants", "api_keys", "usage_records", "audit_entries", "adapters", "refusal_counts",
          "files", "file_chunks", "batches", "batch_lines", "stored_responses", "console_sessions"}


def diff(url: str, metadata: sa.MetaData) -> list:
    engine = sa.create_engine(tdb.sync_url(url))
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, metadata)
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = sa.create_engine(tdb.sync_url(url))
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_matches_models_and_downgrades(db_url):
    head = tdb.head_revision()
    assert head is not None
    assert tdb.schema_status(db_url) == (None, head)           # behind: never migrated

    tdb.upgrade(db_url)
    assert tdb.schema_status(db_url) == (head, head)
    assert tables(db_url) == TABLES | {"alembic_version"}
    assert diff(db_url, Base.metadata) == []

    # The comparison does see a difference when there is one.
    changed = sa.MetaData()
    for table in Base.metadata.sorted_tables:
        table.to_metadata(changed)
    changed.tables["tenants"].append_column(sa.Column("extra", sa.Integer(), nullable=True))
    changed.tables["tenants"].c["name"].type = sa.String(32)
    found = diff(db_url, changed)
    kinds = sorted(d[0] if isinstance(d, tuple) else d[0][0] for d in found)
    assert kinds == ["add_column", "modify_type"], found

    tdb.upgrade(db_url)                                       # already at head: no-op
    assert tdb.schema_status(db_url) == (head, head)

    tdb.downgrade(db_url, "base")
    assert tdb.schema_status(db_url) == (None, head)
    assert tables(db_url) == {"alembic_version"}

    tdb.upgrade(db_url)                                       # and up again
    assert diff(db_url, Base.metadata) == []


def test_plain_sync_urls_are_accepted(sqlite_url):
    plain = sqlite_url.replace("sqlite+aiosqlite://", "sqlite://")
    tdb.upgrade(plain)
    assert tdb.schema_status(sqlite_url) == (tdb.head_revision(),) * 2


async def test_upgrade_from_a_running_event_loop(db_url):
    head = tdb.head_revision()
    await tdb.upgrade_async(db_url)
    assert tdb.schema_status(db_url) == (head, head)   # sync call inside the loop works too
    tdb.downgrade(db_url, "base")
    tdb.upgrade(db_url)
    assert await asyncio.to_thread(tdb.schema_status, db_url) == (head, head)
    assert await tdb.current_revision(db_url) == head


def test_refusal_counts_gain_a_tier_and_lose_it_back(db_url):
    """0010: refusals counted before it take their tenant's default tier; going back adds the
    tiers of one row's key up again."""
    tdb.upgrade(db_url, "0009_console_sessions")
    engine = sa.create_engine(tdb.sync_url(db_url))
    row = {"t": "ten_m", "k": "key_m", "s": "tenant", "r": "requests_per_minute", "m": "2026-12-06 10:00:00+00:00"}
    insert = ("INSERT INTO refusal_counts (tenant_id, api_key_id, scope, reason, minute, count) "
              "VALUES (:t, :k, :s, :r, :m, :n)")
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO tenants (id, name, status, weight, service_tiers, default_tier, "
                                 "cached_input_price, created_at, updated_at) VALUES ('ten_m', 'm', 'active', 1, "
                                 "'[\"default\", \"flex\"]', 'flex', 1, '2026-12-06', '2026-12-06')"))
            conn.execute(sa.text(insert), [{**row, "n": 3}, {**row, "t": "ten_gone", "k": "key_g", "n": 2}])
        tdb.upgrade(db_url)
        with engine.begin() as conn:
            tiers = dict(conn.execute(sa.text("SELECT tenant_id, service_tier FROM refusal_counts")).all())
            assert tiers == {"ten_m": "flex", "ten_gone": "default"}
            conn.execute(sa.text("INSERT INTO refusal_counts (tenant_id, api_key_id, scope, reason, minute, "
                                 "service_tier, count) VALUES (:t, :k, :s, :r, :m, 'priority', :n)"),
                         {**row, "n": 4})
        tdb.downgrade(db_url, "0009_console_sessions")
        with engine.begin() as conn:
            counts = dict(conn.execute(sa.text("SELECT tenant_id, count FROM refusal_counts")).all())
        assert counts == {"ten_m": 7, "ten_gone": 2}
    finally:
        engine.dispose()
