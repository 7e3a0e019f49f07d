"""A PostgreSQL server a test starts, stops and restarts itself (loadtests/harness/pg.py's
`ThrowawayPostgres`): the database going down for real.

    with throwaway_postgres() as pg:
        pg.url            # postgresql+asyncpg://postgres@127.0.0.1:PORT/postgres
        pg.stop()         # immediate shutdown: connections refused from now on
        pg.start()        # back, same data

Skipped where the binaries are missing, failed under `CI=true`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from lockgate.loadtests.harness import pg as harness_pg
from lockgate.loadtests.harness.pg import BIN, ThrowawayPostgres

__all__ = ["BIN", "ThrowawayPostgres", "throwaway_postgres"]


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    if not harness_pg.postgres_available():
        msg = f"no PostgreSQL binaries under {BIN}"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    with harness_pg.throwaway_postgres() as pg:
        yield pg
