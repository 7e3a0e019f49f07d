"""A refunded reservation is charged when its spooled row is replayed: real PostgreSQL and
Redis, gateways in this process.

The outside attack: 12 requests were answered by replica r1 while the database was down
(their rows spooled on r1's disk); r1 was killed; r2's lease reconciler found their admissions
expired with no row and refunded them; r1's restart replayed the 12 rows. The budget ended at
0 against 5,028 tokens in rows. Now `abandon` leaves a marker saying 'refunded', and the
replay charges each such row once: the budget equals the rows, a second replay (the same rows
in another replica's spool) charges nothing more, and a replayed row whose admission was
settled normally (not refunded) is not charged again.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path

import redis
from sqlalchemy import func, select

from lockgate.gateway.serving.ticket import key_scope, tenant_scope
from lockgate.tenancy.limiter import RedisLimiter
from lockgate.tenancy.models import UsageRecord
from lockgate.tenancy.quota import Quota
from lockgate.tenancy.usage.spool import UsageSpool
from lockgate.tenancy.usage.writer import UsageRow
from tests.support.inprocess_gateway import InProcessGateway, running_gateway
from tests.support.services import fresh_pg_database

ROWS = [(300, 119)] * 12          # prompt, completion: 5,028 tokens in all
RESERVED = 500


def row(rid: str, tenant_id: str, prompt: int, completion: int) -> dict:
    return UsageRow(request_id=rid, tenant_id=tenant_id, api_key_id="key_r1", model="tiny",
                    service_tier="default", prompt_tokens=prompt, cached_tokens=0,
                    completion_tokens=completion, status="ok", queue_ms=0.0, ttft_ms=1.0,
                    total_ms=2.0, created_at=datetime.now(UTC)).values()


def day_counter(redis_url: str, prefix: str, tenant_id: str) -> int:
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    try:
        return int(client.get(f"{prefix}{{tenant:{tenant_id}}}:day:{day}") or 0)
    finally:
        client.close()


async def rows_total(g: InProcessGateway, tenant_id: str) -> tuple[int, int]:
    async with g.app.state.lockgate.sessions() as s:
        n, total = (await s.execute(
            select(func.count(), func.coalesce(func.sum(UsageRecord.prompt_tokens
                                                        + UsageRecord.completion_tokens), 0))
            .where(UsageRecord.tenant_id == tenant_id))).one()
    return int(n), int(total)


async def until(predicate, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not await predicate():
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.05)


def replica(data_dir: Path, url: str, redis_url: str, prefix: str):
    return running_gateway(data_dir, "services", database_url=url, redis_url=redis_url,
                           redis_prefix=prefix, lease_ttl_s=1.5, usage_replay_interval_s=0.2)


async def test_refunded_reservations_are_charged_when_their_rows_are_replayed(
        tmp_path, redis_url, redis_prefix):
    with fresh_pg_database() as url:
        async with replica(tmp_path / "r2", url, redis_url, redis_prefix) as r2:
            t, _ = await r2.tenant(quota={"daily_token_budget": 100_000})
            quota = Quota(daily_token_budget=100_000)
            scopes = [tenant_scope(t["id"], quota), key_scope(t["id"], "key_r1", Quota())]
            # r1: admits 12 requests, answers them while the database is down (their rows
            # spooled on its disk), then dies: no settlement, no heartbeat
            r1 = RedisLimiter(redis_url, prefix=redis_prefix, lease_ttl=0.5)
            try:
                for i in range(len(ROWS)):
                    d = await r1.acquire(f"r1-{i}", scopes, RESERVED)
                    assert d.allowed
                # a 13th, answered and settled before the database went down
                settled = (await r1.acquire("r1-settled", scopes, RESERVED)).lease
                await r1.settle(settled, 77)
            finally:
                await r1.close()
            UsageSpool(tmp_path / "r1" / "usage-spool").append(
                [row(f"r1-{i}", t["id"], p, c) for i, (p, c) in enumerate(ROWS)]
                + [row("r1-settled", t["id"], 50, 27)])
            assert day_counter(redis_url, redis_prefix, t["id"]) == len(ROWS) * RESERVED + 77

            # r2's reconciler: expired, no row -> refunded
            async def refunded() -> bool:
                return day_counter(redis_url, redis_prefix, t["id"]) == 77
            await until(refunded)

            async with replica(tmp_path / "r1", url, redis_url, redis_prefix):   # r1 restarts
                async def replayed() -> bool:
                    return (await rows_total(r2, t["id"]))[0] == len(ROWS) + 1
                await until(replayed)
                await asyncio.sleep(0.5)        # the replay's charge (if any) is made
            n, billed = await rows_total(r2, t["id"])
            assert billed == 5028 + 77
            assert day_counter(redis_url, redis_prefix, t["id"]) == billed, \
                "the budget is short of the replayed rows of refunded reservations"

            # the same rows in a third replica's spool (a replay that crashed before deleting
            # its file, as if): nothing is inserted, nothing charged again
            UsageSpool(tmp_path / "r3" / "usage-spool").append(
                [row(f"r1-{i}", t["id"], p, c) for i, (p, c) in enumerate(ROWS)]
                + [row("r1-settled", t["id"], 50, 27)])
            async with replica(tmp_path / "r3", url, redis_url, redis_prefix) as r3:
                async def drained() -> bool:
                    return r3.app.state.lockgate.usage.pending == 0
                await until(drained)
            assert await rows_total(r2, t["id"]) == (n, billed)
            assert day_counter(redis_url, redis_prefix, t["id"]) == billed
