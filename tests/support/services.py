"""Real PostgreSQL and Redis for tests (pytest plugin, loaded by conftest.py).

`bash scripts/services.sh` starts them where they are down. A test that asks for one that
still does not answer is skipped on a developer's machine and fails under `CI=true`.

Fixtures:
- `pg_url`: a fresh, empty PostgreSQL database for this test (dropped afterwards), as an
  async SQLAlchemy URL (`postgresql+asyncpg://...`).
- `sqlite_url`: a fresh SQLite file in the test's tmp_path (`sqlite+aiosqlite:///...`).
- `db_url`: parametrized over both of the above (the test runs twice).
- `redis_url`: `redis://127.0.0.1:6379/0`, after a ping; and `redis_prefix`, a key prefix
  unique to this test, whose keys are deleted afterwards.
- `redis_cluster`: a three-node Redis Cluster of the machine's ``redis-server``
  (`tests.support.redis_cluster`), one per session, stopped at its end; and
  `cluster_prefix`, a key prefix unique to this test, its keys deleted afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets

import pytest

PG_HOST = os.environ.get("LOCKGATE_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("LOCKGATE_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("LOCKGATE_TEST_PG_USER", "postgres")
PG_ADMIN_DB = os.environ.get("LOCKGATE_TEST_PG_DB", "test")
REDIS_URL = os.environ.get("LOCKGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _missing(what: str, exc: BaseException) -> None:
    msg = f"{what} is not reachable ({exc!r}); run `bash scripts/services.sh`"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(msg, pytrace=False)
    pytest.skip(msg)


def _pg_admin():
    import psycopg

    return psycopg.connect(host=PG_HOST, port=PG_PORT, user=PG_USER, dbname=PG_ADMIN_DB,
                           autocommit=True, connect_timeout=3)


@contextlib.contextmanager
def fresh_pg_database():
    """A new empty PostgreSQL database (its async URL), dropped afterwards; any scope."""
    name = f"lg_{os.getpid()}_{secrets.token_hex(4)}"
    try:
        with _pg_admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
        _missing(f"PostgreSQL at {PG_HOST}:{PG_PORT}", exc)
    try:
        yield f"postgresql+asyncpg://{PG_USER}@{PG_HOST}:{PG_PORT}/{name}"
    finally:
        with _pg_admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def check_redis() -> str:
    import redis

    try:
        client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
        client.ping()
        client.close()
    except Exception as exc:  # noqa: BLE001
        _missing(f"Redis at {REDIS_URL}", exc)
    return REDIS_URL


def drop_redis_prefix(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def pg_url():
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite+aiosqlite:///{tmp_path / 'lockgate.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request):
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def redis_url():
    return check_redis()


@pytest.fixture
def redis_prefix(redis_url):
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    yield prefix
    drop_redis_prefix(prefix)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    from tests.support.redis_cluster import LocalRedisCluster

    try:
        cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    except Exception as exc:  # noqa: BLE001 - no redis-server, or it would not form a cluster
        _missing("a local Redis Cluster", exc)
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_prefix(redis_cluster):
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    yield prefix
    redis_cluster.drop_prefix(prefix)
