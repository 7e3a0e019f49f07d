"""Usage rows and their writer: `UsageRow` (one finished request) and `UsageWriter`, a
background task that group-commits rows, through asyncpg directly on PostgreSQL, and spools
them to local disk (`tenancy.usage.spool`) while the database cannot take them.

`UsageWriter` is bookkeeping on the request path and writes no audit entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self

from sqlalchemy import insert
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.models import UsageRecord
from lockgate.tenancy.usage.row import UsageRow
from lockgate.tenancy.usage.spool import UsageSpool

logger = logging.getLogger(__name__)


_STOP = object()
_REPLAY = object()     # the ticker's mark: time to try the spool's rows again


class UsageWriter:
    """Group commit of usage rows: one background task inserts whatever `record` calls have
    queued (up to `max_batch` rows, waiting `max_delay_s` for more; 0, the default, is
    classic group commit: rows that arrive during a commit make up the next batch) in one
    executemany and one transaction, on a connection of its own; each `record` returns once
    its row is committed, or raises. `synchronous_commit=False` (PostgreSQL) acknowledges a
    commit before its WAL reaches the disk: visible at once, but a database crash may lose
    the last moments' rows.

    With `spool_dir`, a batch the database does not take (unreachable, or no answer within
    `timeout_s`, the whole wait: a hung server's connection is dropped, not closed politely)
    is appended to a `UsageSpool` there and fsynced instead, and its `record`s return as
    committed: the rows are durable. While rows are spooled, new batches go to the
    spool too (no waiting on a dead database per batch), and every `replay_interval_s` the
    writer tries to insert the spool's rows (duplicates of a `request_id` skipped, so a crash
    mid-replay duplicates nothing); `pending` counts the rows not yet in the database. Only a
    refused row (an integrity error) or a spool that cannot be written fails its `record`.
    `on_replayed`, if given, is called with each replayed file's rows once they are in the
    database (before the file is deleted; bounded by `timeout_s`, its failure logged): the
    limiter's charge for rows whose reservations were refunded meanwhile, which must be
    idempotent (a crash before the delete replays the file again)."""

    MAX_BATCH_LIMIT = 2000     # 14 bound values a row; stays under SQLite/PostgreSQL limits

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], max_batch: int = 256,
                 max_delay_s: float = 0.0, synchronous_commit: bool = True, *,
                 spool_dir: Path | None = None, timeout_s: float = 5.0,
                 replay_interval_s: float = 1.0,
                 on_replayed: Callable[[list[dict[str, Any]]], Awaitable[object]] | None = None) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) \
                or not 1 <= max_batch <= self.MAX_BATCH_LIMIT:
            raise Invalid("max_batch", f"must be an integer from 1 to {self.MAX_BATCH_LIMIT}")
        if isinstance(max_delay_s, bool) or not isinstance(max_delay_s, (int, float)) \
                or not 0 <= max_delay_s <= 10:
            raise Invalid("max_delay_s", "must be a number of seconds from 0 to 10")
        for name, v in (("timeout_s", timeout_s), ("replay_interval_s", replay_interval_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 600:
                raise Invalid(name, "must be a number of seconds over 0, at most 600")
        self.timeout_s = float(timeout_s)
        self.replay_interval_s = float(replay_interval_s)
        self._spool = UsageSpool(spool_dir) if spool_dir is not None else None
        self.on_replayed = on_replayed
        self._ticker: asyncio.Task[None] | None = None
        self._replay_due = False
        self.spooled = 0          # rows this writer put in the spool
        self.replayed = 0         # spooled rows this writer moved into the database
        self._sessionmaker = sessionmaker
        self._engine = sessionmaker.kw.get("bind")
        self._conn: Any = None
        self.synchronous_commit = synchronous_commit
        self.max_batch = max_batch
        self.max_delay_s = float(max_delay_s)
        self._queue: asyncio.Queue[Any] = asyncio.Queue()    # bound to a loop on first use
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0          # committed batches
        self.rows = 0             # committed rows
        self.largest_batch = 0

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("UsageWriter already started")
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="usage-writer")
        if self._spool is not None:
            self._ticker = loop.create_task(self._tick(), name="usage-spool-ticker")

    @property
    def pending(self) -> int:
        """Rows in the spool, not yet in the database (0 without a spool)."""
        return self._spool.pending if self._spool is not None else 0

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.replay_interval_s)
            if self.pending and not self._replay_due:
                self._replay_due = True
                self._queue.put_nowait(_REPLAY)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def record(self, row: UsageRow) -> None:
        """Queue `row`; return once it is committed (raise if its commit failed)."""
        await self.submit(row)

    def submit(self, row: UsageRow) -> asyncio.Future[None]:
        """Queue `row` now; the future resolves once it is committed (or fails with the
        commit's error). The writer starts on it at the caller's next `await`, so a caller
        can yield once and then do other work while the row is being written."""
        if not isinstance(row, UsageRow):
            raise Invalid("row", f"must be a UsageRow, got {type(row).__name__}")
        if self._task is None:
            raise RuntimeError("UsageWriter is not started")
        if self._closed or self._task.done():
            raise RuntimeError("UsageWriter is closed")
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((row.values(), fut))
        return fut

    async def close(self) -> None:
        """Write everything queued so far (a last try of the spool included), then stop."""
        if self._ticker is not None:
            self._ticker.cancel()
        if self._task is None or self._task.done():
            self._closed = True
            return
        if not self._closed:
            self._closed = True
            self._queue.put_nowait(_STOP)
        await self._task

    def _drain(self, batch: list[tuple[dict[str, Any], asyncio.Future[None]]]) -> bool:
        """Move queued rows into `batch` up to max_batch; True when the stop mark was seen."""
        while len(batch) < self.max_batch:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return False
            if item is _STOP:
                return True
            if item is _REPLAY:
                continue
            batch.append(item)
        return False

    async def _run(self) -> None:
        batch: list[tuple[dict[str, Any], asyncio.Future[None]]] = []
        try:
            stop = False
            while not stop:
                first = await self._queue.get()
                if first is _STOP:
                    break
                if first is _REPLAY:
                    # rows first: a replay may wait timeout_s on a database that hangs
                    if self._replay_due and self._queue.empty():
                        await self._replay()
                    continue
                batch = [first]
                stop = self._drain(batch)
                if not stop and len(batch) < self.max_batch and self.max_delay_s > 0:
                    await asyncio.sleep(self.max_delay_s)
                    stop = self._drain(batch)
                await self._write(batch)
                batch = []
                if self._replay_due and self._queue.empty():
                    await self._replay()
            # Rows queued after the stop mark (a record racing close) still get written.
            while not self._queue.empty():
                batch = []
                self._drain(batch)
                if batch:
                    await self._write(batch)
            batch = []
            if self.pending:
                await self._replay()      # what is still down stays in the spool for the next start
            await self._release()
        finally:
            # Cancelled (e.g. at loop shutdown): nobody may wait forever for its row.
            self._closed = True
            gone = RuntimeError("UsageWriter stopped before the row was written")
            for _, fut in batch:
                _settle(fut, gone)
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if isinstance(item, tuple):
                    _settle(item[1], gone)

    async def _insert(self, rows: list[dict[str, Any]], skip_existing: bool = False) -> None:
        """Insert `rows` in one transaction (`skip_existing`: those whose request_id is there skipped)."""
        if self._engine is None:       # a sessionmaker without an engine: plain sessions
            async with self._sessionmaker() as session:
                try:
                    stmt = _statement(session.get_bind().dialect.name, skip_existing)
                    for start in range(0, len(rows), self.MAX_BATCH_LIMIT):
                        await session.execute(stmt, rows[start:start + self.MAX_BATCH_LIMIT])
                    await session.commit()
                except BaseException:
                    await session.rollback()
                    raise
            return
        engine = self._engine
        on_asyncpg = engine.dialect.name == "postgresql" and engine.dialect.driver == "asyncpg"
        for attempt in (0, 1):        # a connection the server dropped is replaced once
            try:
                if on_asyncpg:
                    await self._insert_asyncpg(engine, rows, skip_existing)
                    return
                if self._conn is None:
                    self._conn = await engine.connect()
                stmt = _statement(engine.dialect.name, skip_existing)
                async with self._conn.begin():
                    for start in range(0, len(rows), self.MAX_BATCH_LIMIT):
                        await self._conn.execute(stmt, rows[start:start + self.MAX_BATCH_LIMIT])
                return
            except IntegrityError:
                raise
            except Exception as exc:
                if _is_integrity_error(exc):
                    raise IntegrityError("INSERT usage_records", None, exc) from exc
                await self._release_quietly()
                if attempt:
                    raise

    async def _insert_asyncpg(self, engine: AsyncEngine, rows: list[dict[str, Any]],
                              skip_existing: bool = False) -> None:
        """PostgreSQL through asyncpg directly: one prepared INSERT, executemany in one
        transaction. A tenth of the CPU of going through SQLAlchemy's async adapter, which
        matters on the path every response waits on; and a connection of the writer's own,
        which it can drop at once when the server hangs."""
        import asyncpg

        if self._conn is None:
            url = engine.url.set(drivername="postgresql")
            self._conn = await asyncpg.connect(url.render_as_string(hide_password=False))
            self._columns = [c.name for c in UsageRecord.__table__.columns if c.name != "id"]
            cols = ", ".join(self._columns)
            marks = ", ".join(f"${i + 1}" for i in range(len(self._columns)))
            # names from the model, values bound as $1..$n: nothing from a request is spliced in
            self._sql = f"INSERT INTO {UsageRecord.__tablename__} ({cols}) VALUES ({marks})"  # noqa: S608
            if not self.synchronous_commit:   # this connection is the writer's alone
                await self._conn.execute("SET synchronous_commit TO off")
        args = [tuple(r.get(c) for c in self._columns) for r in rows]
        sql = self._sql + " ON CONFLICT (request_id) DO NOTHING" if skip_existing else self._sql
        # asyncpg runs executemany atomically (in a transaction of its own when none is open)
        await self._conn.executemany(sql, args)

    async def _release_quietly(self) -> None:
        """Drop the connection at once, ignoring its errors: it is being replaced, and a hung
        server answers a polite close no sooner than the insert (asyncpg's `terminate` does not ask)."""
        conn, self._conn = self._conn, None
        with contextlib.suppress(Exception):
            if hasattr(conn, "terminate"):      # asyncpg's own connection
                conn.terminate()
            elif conn is not None:              # SQLAlchemy's (SQLite, other drivers): 0.25 s of grace
                async with asyncio.timeout(min(self.timeout_s, 0.25)):
                    await conn.close()

    async def _release(self) -> None:
        """Close the connection at shutdown: politely within `timeout_s`, else dropped."""
        try:
            if self._conn is not None:
                async with asyncio.timeout(self.timeout_s):
                    await self._conn.close()
            self._conn = None
        except Exception:  # noqa: BLE001 - a server that does not answer a close: dropped
            await self._release_quietly()

    async def _write(self, batch: list[tuple[dict[str, Any], asyncio.Future[None]]]) -> None:
        """Commit `batch` within `timeout_s` in all, or spool (and fsync) what is not committed."""
        rows = [values for values, _ in batch]
        results: dict[int, BaseException | None] = {}     # row index -> its outcome, once known
        try:
            if self.pending:      # the database is known down: to the spool, in order
                raise ConnectionError("usage rows are being spooled")
            async with asyncio.timeout(self.timeout_s):
                await self._commit(rows, results)
        except Exception as exc:  # noqa: BLE001 - spooled, else handed to every caller left
            await self._release_quietly()
            rest = [i for i in range(len(rows)) if i not in results]
            error = await self._to_spool([rows[i] for i in rest], exc)
            results.update(dict.fromkeys(rest, error))
        for i, (_, fut) in enumerate(batch):
            _settle(fut, results[i])

    async def _commit(self, rows: list[dict[str, Any]], results: dict[int, BaseException | None]) -> None:
        """Insert `rows` in one transaction; should one be refused (an integrity error, e.g. a
        repeated request_id), each on its own, so that it does not sink the others. Outcomes go
        into `results` as they are known; any other error propagates (the rest are spooled)."""
        try:
            await self._insert(rows)
        except IntegrityError:
            for i, values in enumerate(rows):
                try:
                    await self._insert([values])
                except IntegrityError as one_exc:
                    results[i] = one_exc
                else:
                    self._count(1)
                    results[i] = None
            return
        self._count(len(rows))
        results.update(dict.fromkeys(range(len(rows))))

    async def _to_spool(self, rows: list[dict[str, Any]], exc: BaseException) -> BaseException | None:
        """Spool rows the database did not take; None once they are on disk, else the error."""
        if self._spool is None:
            return exc
        try:
            await asyncio.to_thread(self._spool.append, rows)
        except OSError as spool_exc:
            logger.error("usage spool not writable (%r); %d rows not recorded", spool_exc, len(rows))
            return spool_exc
        if not self.spooled or not isinstance(exc, ConnectionError):
            logger.warning("usage rows spooled to %s: the database did not take them (%r)",
                           self._spool.directory, exc)
        self.spooled += len(rows)
        return None

    async def _replay(self) -> None:
        """Move the spool's rows into the database, file by file, each within timeout_s
        (duplicates of a request_id skipped); stop at the first failure (the next tick tries
        again)."""
        spool = self._spool
        try:
            if spool is None:
                return
            for path in await asyncio.to_thread(spool.take):
                rows = await asyncio.to_thread(spool.read, path)
                async with asyncio.timeout(self.timeout_s):
                    await self._insert(rows, skip_existing=True)
                await self._replayed(rows)
                await asyncio.to_thread(spool.done, path)
                self.replayed += len(rows)
                logger.info("usage spool: %d rows replayed into the database", len(rows))
        except Exception as exc:  # noqa: BLE001 - the database is still away: retried on the next tick
            await self._release_quietly()
            logger.info("usage spool replay deferred (%d rows pending): %r", self.pending, exc)
        finally:
            self._replay_due = False      # until now: no second mark while this one runs

    async def _replayed(self, rows: list[dict[str, Any]]) -> None:
        if self.on_replayed is None or not rows:
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.on_replayed(rows)
        except Exception:  # the rows are in; only their charge is missing, logged
            logger.exception("usage spool: the hook on %d replayed rows failed", len(rows))

    def _count(self, n: int) -> None:
        self.batches += 1
        self.rows += n
        self.largest_batch = max(self.largest_batch, n)


def _statement(dialect: str, skip_existing: bool) -> Any:
    """INSERT into usage_records; with `skip_existing`, rows whose request_id is there are skipped."""
    if not skip_existing:
        return insert(UsageRecord)
    make = postgresql.insert if dialect == "postgresql" else sqlite.insert
    return make(UsageRecord).on_conflict_do_nothing(index_elements=["request_id"])


def _is_integrity_error(exc: BaseException) -> bool:
    """asyncpg's unique/foreign-key/check violations (SQLSTATE class 23)."""
    return str(getattr(exc, "sqlstate", "") or "").startswith("23")


def _settle(fut: asyncio.Future[None], exc: BaseException | None) -> None:
    if fut.done():      # the caller was cancelled; the row's fate no longer matters to it
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)

