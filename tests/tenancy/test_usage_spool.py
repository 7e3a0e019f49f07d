"""The usage spool, so that no served request's usage is lost to a database outage: with
the database down, `UsageWriter.record` still returns once the row is durable in a local
JSON-lines spool, and the spool is replayed into the database exactly once when it returns.
The database is a PostgreSQL this test starts and stops itself (tests/support/throwaway_pg.py)."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from lockgate.tenancy import api_keys, db, tenants
from lockgate.tenancy.usage.spool import UsageSpool
from lockgate.tenancy.usage.writer import UsageRow, UsageWriter
from tests.support.throwaway_pg import throwaway_postgres


def row(request_id: str, tenant_id: str, key_id: str, prompt: int = 3) -> UsageRow:
    return UsageRow(request_id=request_id, tenant_id=tenant_id, api_key_id=key_id, model="m",
                    service_tier="default", prompt_tokens=prompt, cached_tokens=0,
                    completion_tokens=2, status="ok", queue_ms=1.0, ttft_ms=2.0, total_ms=3.0,
                    client_request_id=f"client-{request_id}")


@pytest.fixture(scope="module")
def pg():
    with throwaway_postgres() as server:
        db.upgrade(server.url)
        yield server


@pytest.fixture
async def setup(pg):
    engine = db.make_engine(pg.url)
    sessions = db.make_sessionmaker(engine)
    async with sessions() as s:
        t = await tenants.create_tenant(s, name=f"t{time.time_ns()}", actor="test")
        k, _ = await api_keys.create_key(s, tenant_id=t.id, name="k", pepper=b"p" * 32, actor="test")
    yield sessions, t.id, k.id
    await engine.dispose()


async def stored(sessions, tenant_id: str) -> list[tuple[str, str | None]]:
    from sqlalchemy import text

    async with sessions() as s:
        res = await s.execute(text("SELECT request_id, client_request_id FROM usage_records "
                                   "WHERE tenant_id = :t ORDER BY request_id"), {"t": tenant_id})
        return [tuple(r) for r in res.all()]


async def until(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_rows_spooled_while_the_database_is_down_are_replayed_once(pg, setup, tmp_path):
    sessions, tid, kid = setup
    writer = UsageWriter(sessions, spool_dir=tmp_path, timeout_s=1.0, replay_interval_s=0.1)
    await writer.start()
    try:
        await writer.record(row("a0", tid, kid))
        pg.stop()
        t0 = time.monotonic()
        await asyncio.gather(*(writer.record(row(f"b{i}", tid, kid)) for i in range(5)))
        assert time.monotonic() - t0 < 3
        assert writer.pending == 5
        lines = (tmp_path / "usage-spool.jsonl").read_text().splitlines()
        assert sorted(json.loads(x)["request_id"] for x in lines) == [f"b{i}" for i in range(5)]
        await writer.record(row("c0", tid, kid))          # still down: spooled behind them
        assert writer.pending == 6
        pg.start()

        async def drained() -> bool:
            return writer.pending == 0

        await until(drained)
    finally:
        await writer.close()
    got = await stored(sessions, tid)
    assert got == [(r, f"client-{r}") for r in ["a0", *(f"b{i}" for i in range(5)), "c0"]]
    assert writer.replayed == 6 and not list(tmp_path.glob("usage-spool*"))


async def test_a_replay_cut_by_a_crash_duplicates_nothing(pg, setup, tmp_path):
    """A previous process spooled 4 rows, replayed 2 of them into the database and died
    before deleting the file: the next writer replays the file, and each row is there once."""
    sessions, tid, kid = setup
    spool = UsageSpool(tmp_path)
    spool.append([row(f"d{i}", tid, kid).values() for i in range(4)])
    with (tmp_path / "usage-spool.jsonl").open("ab") as f:
        f.write(b'{"request_id": "torn')                  # an append the crash cut short
    [path] = spool.take()
    async with sessions() as s:
        from sqlalchemy import insert

        from lockgate.tenancy.models import UsageRecord

        await s.execute(insert(UsageRecord), spool.read(path)[:2])
        await s.commit()
    writer = UsageWriter(sessions, spool_dir=tmp_path, timeout_s=1.0, replay_interval_s=0.1)
    assert writer.pending == 4
    await writer.start()
    try:
        async def drained() -> bool:
            return writer.pending == 0

        await until(drained)
    finally:
        await writer.close()
    assert await stored(sessions, tid) == [(f"d{i}", f"client-d{i}") for i in range(4)]
    assert not list(tmp_path.glob("usage-spool*"))


def spooled_ids(directory) -> list[str]:
    """The request ids in the spool's files (replays first, as `UsageSpool.take` orders them)."""
    return [json.loads(x)["request_id"] for f in sorted(directory.glob("usage-spool*"))
            for x in f.read_text().splitlines()]


async def test_a_hung_database_spools_the_row_within_the_timeout_and_replays_it_once(pg, setup, tmp_path):
    """PostgreSQL SIGSTOPped under open connections: the insert gets no answer, and neither
    would a graceful close. `record` returns once the row is spooled, within `timeout_s` plus
    a margin (0.9 s: under the two timeouts in a row of waiting on the insert, then on a
    polite close), the bound being the total (a hung connection is dropped, not closed),
    whether the hang meets an insert or a replay of the spool (each round: the first row
    meets the insert, the second a replay under way); once the server answers again the rows
    are replayed, once each."""
    _, tid, kid = setup
    timeout, margin = 1.0, 0.9
    # as the gateway builds it (gateway/app.py `database_engine`): every wait bounded
    engine = db.make_engine(pg.url, pool_timeout=timeout,
                            connect_args={"timeout": timeout, "command_timeout": timeout})
    sessions = db.make_sessionmaker(engine)
    writer = UsageWriter(sessions, spool_dir=tmp_path, timeout_s=timeout, replay_interval_s=0.1)

    async def drained() -> bool:
        return writer.pending == 0

    await writer.start()
    try:
        await writer.record(row("h0", tid, kid))          # the writer's connection is open
        for names in (("h1", "h2"), ("h3", "h4")):
            pg.pause()
            try:
                # the first meets the hang; the second a replay under way, then the spool
                for name in names:
                    task = asyncio.create_task(writer.record(row(name, tid, kid)))
                    done, _ = await asyncio.wait({task}, timeout=timeout + margin)
                    assert task in done, f"record({name}) not spooled within timeout + {margin} s of a hung database"
                    await task
                    await asyncio.sleep(0.2)              # the ticker's replay begins
                assert spooled_ids(tmp_path) == list(names)
            finally:
                pg.resume()
            await until(drained, timeout=15)
    finally:
        await writer.close()
        await engine.dispose()
    assert await stored(sessions, tid) == [(r, f"client-{r}") for r in ("h0", "h1", "h2", "h3", "h4")]
    assert writer.replayed == 4 and writer.spooled == 4
