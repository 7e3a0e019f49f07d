"""Which database errors mean "the database cannot serve now" (503 database_unavailable, the
key cache and the spool take over) rather than "it refused this statement"."""

from __future__ import annotations

import asyncpg
from sqlalchemy.exc import DBAPIError, ProgrammingError

from lockgate.gateway.errors import is_database_down


def test_a_database_still_starting_is_down_and_a_refused_statement_is_not():
    starting = asyncpg.exceptions.CannotConnectNowError("the database system is starting up")
    assert starting.sqlstate == "57P03"
    assert is_database_down(DBAPIError("connect", None, starting))
    wrapped = DBAPIError("connect", None, Exception("adapted"))
    wrapped.orig.__cause__ = starting
    assert is_database_down(wrapped)
    refused = asyncpg.exceptions.UniqueViolationError("duplicate key")
    assert not is_database_down(ProgrammingError("insert", None, refused))
