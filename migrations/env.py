"""Alembic environment for Lockgate: async engines (aiosqlite/asyncpg) via run_sync.

Normally driven by `tenancy.db.upgrade`; `alembic -c migrations/alembic.ini upgrade head`
works too, with the URL from `-x url=...` or LOCKGATE_DATABASE_URL."""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.pool import NullPool

from lockgate.tenancy.db import async_url, make_engine
from lockgate.tenancy.models import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None:     # the alembic CLI with migrations/alembic.ini
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = (
        config.attributes.get("lockgate_url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("LOCKGATE_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise RuntimeError("no database URL: pass -x url=... or set LOCKGATE_DATABASE_URL")
    return async_url(url)


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def _run_sync(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = make_engine(_url(), poolclass=NullPool)
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
    finally:
        await engine.dispose()


def run_offline() -> None:
    url = _url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.startswith("sqlite"),
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:      # a caller-provided sync connection
        _run_sync(connection)
    else:
        asyncio.run(_run_async())


if context.is_offline_mode():
    run_offline()
else:
    run_online()
