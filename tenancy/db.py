"""Engine, sessions, transactions and schema migrations for the tenancy database (SQLite or
PostgreSQL).

URLs may name the sync drivers (`sqlite:///`, `postgresql://`, `postgres://`); they are
normalised to the async ones (aiosqlite, asyncpg)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.pool import NullPool

from lockgate.tenancy.errors import Invalid

T = TypeVar("T")

_ASYNC_DRIVERS = {"sqlite": "aiosqlite", "postgresql": "asyncpg"}
_SYNC_ONLY = {"sqlite": {"pysqlite", "pysqlcipher"}, "postgresql": {"psycopg2", "pg8000"}}


def async_url(url: str) -> str:
    """`url` with an async driver: plain sqlite/postgresql/postgres URLs get aiosqlite/asyncpg."""
    if not isinstance(url, str) or not url.strip():
        raise Invalid("database_url", "must be a non-empty URL")
    url = url.strip()
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise Invalid("database_url", f"cannot parse {url!r}: {exc}") from None
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    if backend not in _ASYNC_DRIVERS:
        raise Invalid("database_url", f"unsupported database {backend!r}; use sqlite or postgresql")
    if "+" not in parsed.drivername or driver in _SYNC_ONLY[backend]:
        parsed = parsed.set(drivername=f"{backend}+{_ASYNC_DRIVERS[backend]}")
    return parsed.render_as_string(hide_password=False)


def sync_url(url: str) -> str:
    """The same database with a sync driver (`sqlite:///`, `postgresql+psycopg://`), e.g. for
    tools that want a sync connection."""
    parsed = make_url(async_url(url))
    backend = parsed.get_backend_name()
    parsed = parsed.set(drivername="sqlite" if backend == "sqlite" else "postgresql+psycopg")
    return parsed.render_as_string(hide_password=False)


def _sqlite_on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA busy_timeout=10000")
    finally:
        cursor.close()


def _create_private_sqlite_file(url: str) -> None:
    """Create a SQLite database file that does not exist yet with mode 0600, whatever the
    umask (SQLite gives its -wal and -shm files the database file's mode)."""
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return
    try:
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return                    # an existing database keeps the mode it has
    except OSError:
        return                    # no such directory, or not writable: SQLite says so on connect
    os.chmod(database, 0o600)


def make_engine(url: str, **kwargs: Any) -> AsyncEngine:
    """An async engine for `url`; on SQLite, foreign keys and WAL are on for every connection
    and a new database file is created private (0600)."""
    url = async_url(url)
    kwargs.setdefault("pool_pre_ping", not url.startswith("sqlite"))
    engine = create_async_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        _create_private_sqlite_file(url)
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
    return engine


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions whose objects stay readable after commit."""
    return async_sessionmaker(engine, expire_on_commit=False)


async def ping(session: AsyncSession) -> None:
    """Raise unless the database answers."""
    await session.execute(text("SELECT 1"))


async def in_transaction(session: AsyncSession, work: Callable[[], Awaitable[T]]) -> T:
    """Run `work` then commit; roll everything back on any error."""
    try:
        result = await work()
        await session.commit()
    except BaseException:
        await session.rollback()
        raise
    return result


def is_unique_violation(exc: IntegrityError, column: str) -> bool:
    """Whether `exc` is a UNIQUE violation on `column` (SQLite's and PostgreSQL's wording)."""
    message = str(exc.orig).lower()
    return column in message and ("unique" in message or "duplicate" in message)


# -- migrations --------------------------------------------------------------------------------


def script_location() -> Path:
    from lockgate import migrations

    return Path(migrations.__file__).parent


def alembic_config(url: str) -> Config:
    """An Alembic config for `url` (async driver), without any alembic.ini."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    url = async_url(url)
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["lockgate_url"] = url   # read by env.py; no ConfigParser interpolation
    return cfg


def _run_blocking(fn: Callable[[], T]) -> T:
    """Run `fn` here, or in a worker thread when this thread runs an event loop (env.py
    drives the async engine with asyncio.run, which cannot nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lockgate-migrate") as pool:
        return pool.submit(fn).result()


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (blocking)."""
    cfg = alembic_config(url)
    _run_blocking(lambda: command.upgrade(cfg, revision))


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the database at `url` down to `revision` (blocking)."""
    cfg = alembic_config(url)
    _run_blocking(lambda: command.downgrade(cfg, revision))


async def upgrade_async(url: str, revision: str = "head") -> None:
    """`upgrade` from async code, without blocking the event loop."""
    await asyncio.to_thread(upgrade, url, revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


async def current_revision(url: str) -> str | None:
    """The revision stamped in the database (None when it was never migrated)."""
    engine = make_engine(url, poolclass=NullPool)
    try:
        async with engine.connect() as conn:
            return await conn.run_sync(
                lambda sync_conn: MigrationContext.configure(sync_conn).get_current_revision()
            )
    finally:
        await engine.dispose()


def _in_new_loop(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return _run_blocking(lambda: asyncio.run(factory()))


def schema_status(url: str) -> tuple[str | None, str]:
    """(current revision of the database, head revision of the code); equal when up to date."""
    head = head_revision()
    if head is None:
        raise RuntimeError("no migration scripts found")
    return _in_new_loop(lambda: current_revision(url)), head
