"""The files' chunks migration keeps what was stored before it, on SQLite and PostgreSQL: a
file's bytes in its one column still read back exactly (`batches.file_chunks`), a batch
line's custom_id (backslashes in it) reads back as written, and a downgrade puts a chunked
file's bytes back into its column."""

from __future__ import annotations

import sqlalchemy as sa

from lockgate.tenancy import batches as store
from lockgate.tenancy import db as tdb
from lockgate.tenancy.models import BatchLine

NOW = "2026-12-01 00:00:00+00:00"


def run(url: str, *statements: tuple[str, dict]) -> list:
    engine = sa.create_engine(tdb.sync_url(url))
    try:
        with engine.begin() as conn:
            return [conn.execute(sa.text(sql), args).all() if sql.startswith("SELECT")
                    else conn.execute(sa.text(sql), args) for sql, args in statements]
    finally:
        engine.dispose()


async def test_rows_stored_before_the_chunks_read_back_exactly(db_url):
    tdb.upgrade(db_url, "0005")
    legacy = b'{"custom_id": "a\\\\b"}\n\x00\xff'
    run(db_url,
        ("INSERT INTO tenants (id, name, status, weight, service_tiers, default_tier, created_at, updated_at) "
         "VALUES ('ten_1', 't', 'active', 1.0, '[]', 'default', :t, :t)", {"t": NOW}),
        ("INSERT INTO files (id, tenant_id, purpose, filename, bytes, content, created_at) "
         "VALUES ('file-old', 'ten_1', 'batch', 'a.jsonl', :n, :c, :t)", {"n": len(legacy), "c": legacy, "t": NOW}),
        ("INSERT INTO batches (id, tenant_id, api_key_id, endpoint, input_file_id, completion_window, "
         "status, total, created_at, expires_at) VALUES ('batch_1', 'ten_1', 'k', '/v1/completions', "
         "'file-old', '24h', 'validating', 1, :t, :t)", {"t": NOW}),
        ("INSERT INTO batch_lines (batch_id, line, custom_id, status) VALUES ('batch_1', 0, :c, 'pending')",
         {"c": "a\\b\\0"}))
    tdb.upgrade(db_url)
    engine = tdb.make_engine(db_url)
    try:
        async with tdb.make_sessionmaker(engine)() as session:
            assert await store.file_bytes(session, "file-old") == legacy
            line = (await session.execute(sa.select(BatchLine))).scalar_one()
            assert line.custom_id == "a\\b\\0"
            f = await store.create_file(session, tenant_id="ten_1", purpose="batch", filename="n.jsonl",
                                        content=b"x" * ((1 << 20) + 5))
            assert await store.file_bytes(session, f.id) == b"x" * ((1 << 20) + 5)
    finally:
        await engine.dispose()
    tdb.downgrade(db_url, "0005")
    (rows,) = run(db_url, ("SELECT id, content FROM files ORDER BY id", {}))
    assert [(i, bytes(c)) for i, c in rows] == [(f.id, b"x" * ((1 << 20) + 5)), ("file-old", legacy)]
    (rows,) = run(db_url, ("SELECT custom_id FROM batch_lines", {}))
    assert rows == [("a\\b\\0",)]
