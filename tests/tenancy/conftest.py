"""What the tenancy tests share: `sessions`, a session factory on a migrated database of
each backend (`db_url`: SQLite and PostgreSQL), disposed afterwards."""

from __future__ import annotations

import pytest

from lockgate.tenancy import db as tdb


@pytest.fixture
async def sessions(db_url):
    await tdb.upgrade_async(db_url)
    engine = tdb.make_engine(db_url)
    try:
        yield tdb.make_sessionmaker(engine)
    finally:
        await engine.dispose()
