"""`lockgate bench console`: each console page's render time (p50, p95) at many usage rows
(100,000 by default, inserted in one SQL statement), against a scratch PostgreSQL database, the
app in this process on the instant engine, each page asked through ASGI as a signed-in admin.
Target: every page's p95 under 300 ms. The SQL statements each page issues are counted too
(`statements_run`), which tests/gateway/test_console_bounds.py holds fixed whatever the rows.

    lockgate bench console --rows 100000 --repeats 30
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event, text

# every console page a signed-in admin reads: (name, path; {tenant_id} filled in)
PAGES: tuple[tuple[str, str], ...] = (
    ("overview", "/console/"),
    ("tenants", "/console/tenants"),
    ("tenant", "/console/tenants/{tenant_id}"),
    ("keys", "/console/keys"),
    ("usage", "/console/usage"),
    ("usage by model, day", "/console/usage?group_by=model,day"),
    ("usage by key, tier", "/console/usage?group_by=key,service_tier&tenant_id={tenant_id}"),
    ("usage.csv", "/console/usage.csv?group_by=tenant"),
    ("models", "/console/models"),
    ("quotas", "/console/quotas"),
    ("engine", "/console/engine"),
    ("engine live", "/console/engine/live"),
    ("audit", "/console/audit"),
)
TARGET_P95_MS = 300.0
TENANTS = 5

# one statement however many rows: a row per number of generate_series, spread over the
# tenants (and their keys), the tiers and the last 30 days
FILL_PG = text("""
INSERT INTO usage_records (request_id, tenant_id, api_key_id, model, service_tier, prompt_tokens,
    cached_tokens, completion_tokens, budget_tokens, status, queue_ms, ttft_ms, total_ms, created_at)
SELECT :tag || g, (CAST(:tenants AS text[]))[1 + g % :n_tenants], (CAST(:keys AS text[]))[1 + g % :n_tenants],
    'tiny', (ARRAY['default', 'flex', 'priority'])[1 + g % 3], 20 + g % 50, g % 7, 10 + g % 90,
    30 + g % 140, CASE WHEN g % 50 = 0 THEN 'error' ELSE 'ok' END, g % 13, 5 + g % 40, 50 + g % 400,
    now() - make_interval(mins => g % 43200)
FROM generate_series(1, :n) AS g
""")

_counting: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("console_sql", default=None)


@contextlib.contextmanager
def counting_statements(db: Any) -> Iterator[None]:
    """Count the SQL statements `db` (an async engine) runs in the task asking for them
    (`statements_run`), not those of the app's background tasks."""
    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        seen = _counting.get()
        if seen is not None:
            seen.append(statement)

    event.listen(db.sync_engine, "before_cursor_execute", before)
    try:
        yield
    finally:
        event.remove(db.sync_engine, "before_cursor_execute", before)


@contextlib.contextmanager
def statements_run() -> Iterator[list[str]]:
    """The statements run in this context (and the tasks it starts) while open."""
    seen: list[str] = []
    token = _counting.set(seen)
    try:
        yield seen
    finally:
        _counting.reset(token)


async def fill_usage(session: Any, n: int, tenants: list[str], keys: list[str]) -> None:
    """`n` more usage rows of these tenants (and their keys, in the same order), in one
    statement (PostgreSQL)."""
    if n <= 0:
        return
    await session.execute(FILL_PG, {"tag": f"bench-{secrets.token_hex(4)}-", "tenants": tenants, "keys": keys,
                                    "n_tenants": len(tenants), "n": n})
    await session.commit()


async def sign_in(client: httpx.AsyncClient, key: str) -> None:
    """A console session for `key` in `client`'s cookies."""
    form = await client.get("/console/sign-in")
    m = re.search(r'name="csrf" value="([0-9a-f]{64})"', form.text)
    if m is None:
        raise RuntimeError(f"no sign-in form: {form.status_code} {form.text[:300]}")
    r = await client.post("/console/sign-in", data={"key": key, "csrf": m.group(1)})
    if r.status_code != 303:
        raise RuntimeError(f"sign-in refused: {r.status_code} {r.text[:300]}")


async def make_tenants(admin: httpx.AsyncClient, n: int) -> tuple[list[str], list[str]]:
    """`n` tenants, each with a key and a quota: (tenant ids, key ids)."""
    tenants, keys = [], []
    for i in range(n):
        r = await admin.post("/tenants", json={"name": f"bench-{i}-{secrets.token_hex(3)}", "service_tiers": [
            "default", "flex", "priority"], "quota": {"requests_per_minute": 600, "daily_token_budget": 10**9}})
        r.raise_for_status()
        tenants.append(r.json()["id"])
        k = await admin.post(f"/tenants/{tenants[-1]}/keys", json={"name": "bench"})
        k.raise_for_status()
        keys.append(k.json()["id"])
    return tenants, keys


@dataclass
class PageTimes:
    name: str
    status: int
    statements: int
    p50_ms: float
    p95_ms: float

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.p95_ms < TARGET_P95_MS


async def time_page(client: httpx.AsyncClient, name: str, path: str, repeats: int) -> PageTimes:
    """One page asked once to warm it, then `repeats` times: its status, statements, times."""
    with statements_run() as seen:
        first = await client.get(path)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = await client.get(path)
        times.append((time.perf_counter() - t0) * 1000)
        if r.status_code != first.status_code:
            raise RuntimeError(f"{path}: {r.status_code} after {first.status_code}")
    times.sort()
    p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
    return PageTimes(name, first.status_code, len(seen), statistics.median(times), p95)


@contextlib.asynccontextmanager
async def console_app(database_url: str, data_dir: Path) -> AsyncIterator[tuple[Any, str]]:
    """The app on `database_url` (migrated), its lifespan entered: (app, admin key)."""
    from lockgate.gateway.app import create_app
    from lockgate.gateway.settings import Settings
    from lockgate.loadtests.cache import demo_model_dir
    from lockgate.loadtests.instant_engine import InstantEngine

    admin_key = "lg-" + secrets.token_urlsafe(32)
    s = Settings(data_dir=data_dir, database_url=database_url, migrate=True, admin_key=admin_key,
                 pepper=secrets.token_hex(32), models=[f"tiny={demo_model_dir('llama', 'tiny', 0)}"],
                 console_sign_ins_per_minute=1000)
    app = create_app(s, engine_factory=InstantEngine)
    async with app.router.lifespan_context(app):
        yield app, admin_key


def _clients(app: Any, admin_key: str) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    return (httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=60),
            httpx.AsyncClient(transport=transport, base_url="http://bench/admin/v1", timeout=60,
                              headers={"Authorization": f"Bearer {admin_key}"}))


async def run_bench(database_url: str, rows: int, repeats: int, echo: Callable[[str], None]) -> list[PageTimes]:
    """Every page's times at `rows` usage rows on the (empty) database `database_url`."""
    with tempfile.TemporaryDirectory(prefix="lockgate-bench-console-") as tmp:
        async with console_app(database_url, Path(tmp)) as (app, admin_key):
            state = app.state.lockgate
            client, admin = _clients(app, admin_key)
            async with client, admin:
                tenants, keys = await make_tenants(admin, TENANTS)
                t0 = time.perf_counter()
                async with state.sessions() as session:
                    await fill_usage(session, rows, tenants, keys)
                echo(f"{rows} usage rows inserted in {time.perf_counter() - t0:.1f} s (one statement)")
                await sign_in(client, admin_key)
                with counting_statements(state.db):
                    return [await time_page(client, name, path.format(tenant_id=tenants[0]), repeats)
                            for name, path in PAGES]


def table(results: list[PageTimes], rows: int) -> str:
    lines = [f"console pages at {rows} usage rows (target p95 < {TARGET_P95_MS:.0f} ms)",
             f"{'page':<22} {'status':>6} {'SQL':>4} {'p50 ms':>8} {'p95 ms':>8}  ok"]
    for r in results:
        lines.append(f"{r.name:<22} {r.status:>6} {r.statements:>4} {r.p50_ms:>8.1f} {r.p95_ms:>8.1f}  "
                     f"{'yes' if r.ok else 'NO'}")
    return "\n".join(lines)


def bench_console(database_url: str, rows: int, repeats: int, echo: Callable[[str], None] = print) -> bool:
    """A scratch database on the server of `database_url`, the bench, the table; dropped
    afterwards. True when every page answered 200 within the target."""
    import asyncio

    from lockgate.loadtests.harness.services import pg_dsn, pg_execute

    admin_dsn = pg_dsn(database_url)
    name = f"lg_bench_console_{secrets.token_hex(4)}"
    pg_execute(admin_dsn, f'CREATE DATABASE "{name}"')
    try:
        url = pg_dsn(database_url, name).replace("postgresql://", "postgresql+asyncpg://", 1)
        results = asyncio.run(run_bench(url, rows, repeats, echo))
    finally:
        pg_execute(admin_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    echo(table(results, rows))
    return all(r.ok for r in results)
