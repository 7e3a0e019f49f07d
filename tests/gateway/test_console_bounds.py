"""Each console page issues a fixed number of SQL statements whatever the usage rows: counted
(SQLAlchemy's before_cursor_execute, in the request's own context) for every page at 10 usage
rows, again at 100,000 (one INSERT ... generate_series), and again with more tenants than a page
holds, on PostgreSQL, in this process.
The same pages' render times at 100,000 rows: `lockgate bench console` (loadtests/bench_console.py),
whose small run is smoke-tested here."""

from __future__ import annotations

import pytest
import pytest_asyncio
from sqlalchemy import func, select

from lockgate.loadtests.bench_console import PAGES, counting_statements, fill_usage, make_tenants, statements_run
from lockgate.tenancy.models import UsageRecord
from tests.gateway.test_console import sign_in
from tests.support.inprocess_gateway import InProcessGateway, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gw(tmp_path_factory) -> InProcessGateway:
    async with running_gateway(tmp_path_factory.mktemp("bounds"), "postgresql", engine="fake",
                               console_sign_ins_per_minute=1000) as g:
        yield g


async def _counts(gw: InProcessGateway, tenant: str) -> dict[str, tuple[int, int]]:
    """Each page's (status, statements), asked twice (the second counted: caches warm)."""
    c = await sign_in(gw, gw.admin_key)
    state = gw.app.state.lockgate
    out = {}
    with counting_statements(state.db):
        for name, path in PAGES:
            url = path.format(tenant_id=tenant)
            await c.get(url)
            with statements_run() as seen:
                r = await c.get(url)
            out[name] = (r.status_code, len(seen))
    return out


async def _rows(gw: InProcessGateway) -> int:
    async with gw.app.state.lockgate.sessions() as session:
        return (await session.execute(select(func.count()).select_from(UsageRecord))).scalar_one()


async def test_every_page_issues_as_many_statements_at_100000_rows_as_at_10(gw):
    tenants, keys = await make_tenants(gw.admin, 5)
    async with gw.app.state.lockgate.sessions() as session:
        await fill_usage(session, 10, tenants, keys)
    assert await _rows(gw) == 10
    small = await _counts(gw, tenants[0])
    async with gw.app.state.lockgate.sessions() as session:
        await fill_usage(session, 100_000 - 10, tenants, keys)
    assert await _rows(gw) == 100_000
    large = await _counts(gw, tenants[0])
    assert {n for n, (status, _) in small.items() if status != 200} == set(), small
    assert large == small, {n: (small[n], large[n]) for n in small if small[n] != large[n]}
    assert all(0 < count <= 12 for _, count in small.values()), small
    # the session, its key, and the timeline: usage and refusals per hour and tier in one statement
    assert small["overview"] == (200, 3), small
    # more tenants than a page holds (each tenant's keys read in the same statement)
    await make_tenants(gw.admin, 25)
    assert await _counts(gw, tenants[0]) == small
    print({n: c for n, (_, c) in small.items()})
