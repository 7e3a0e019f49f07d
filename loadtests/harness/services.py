"""PostgreSQL and Redis for a benchmark: a check that names the one that does not answer, a
scratch database's statements, and the count or removal of the keys under a Redis prefix."""

from __future__ import annotations

import asyncio
from typing import Any


class ServiceUnavailable(RuntimeError):
    """PostgreSQL or Redis does not answer: the benchmark cannot run."""


def pg_dsn(url: str, database: str | None = None) -> str:
    from sqlalchemy.engine import make_url

    u = make_url(url.replace("postgres://", "postgresql://", 1))
    if u.get_backend_name() != "postgresql":
        raise ServiceUnavailable(f"--database-url must be a PostgreSQL URL, got {url!r}")
    u = u.set(drivername="postgresql")
    if database is not None:
        u = u.set(database=database)
    return u.render_as_string(hide_password=False)


def pg_execute(dsn: str, *statements: str) -> list[Any]:
    import asyncpg

    async def run() -> list[Any]:
        conn = await asyncpg.connect(dsn, timeout=5)
        try:
            return [await conn.fetchval(s) for s in statements]
        finally:
            await conn.close()

    return asyncio.run(run())


def check_services(database_url: str, redis_url: str) -> None:
    """Raise ServiceUnavailable, naming the service, when either does not answer."""
    dsn = pg_dsn(database_url)
    try:
        pg_execute(dsn, "SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        raise ServiceUnavailable(
            f"PostgreSQL at {pg_dsn(database_url)} is not reachable ({exc!r}); start it "
            "(`bash scripts/services.sh`) or pass --database-url") from None
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_connect_timeout=3, socket_timeout=3)
        client.ping()
        client.close()
    except Exception as exc:  # noqa: BLE001
        raise ServiceUnavailable(
            f"Redis at {redis_url} is not reachable ({exc!r}); start it "
            "(`bash scripts/services.sh`) or pass --redis-url") from None


def redis_keys(redis_url: str, prefix: str, delete: bool) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=prefix + "*", count=1000))
        if delete and keys:
            for i in range(0, len(keys), 1000):
                client.delete(*keys[i:i + 1000])
        return len(keys)
    finally:
        client.close()


