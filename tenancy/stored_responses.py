"""The Responses API's stored responses: each a request's input items and its Response object,
kept per tenant until its retention runs out. Keyword-only async functions over a session;
every read takes the tenant, so another tenant's response is indistinguishable from none
(`NotFound`), and so is one deleted or past its `expires_at` (whether or not a sweep has
deleted its row yet).

A conversation continued by `previous_response_id` is the chain of responses back through
their own `previous_response_id`s (`conversation`): each one's input items, then its output
items, oldest first. A link that is gone (deleted, expired) ends the chain there; the
response named by the request itself must be live.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from lockgate.tenancy.db import in_transaction
from lockgate.tenancy.errors import Invalid, NotFound
from lockgate.tenancy.models import StoredResponse, utcnow

MAX_CHAIN = 1000       # responses read back through previous_response_id, at most


async def store_response(session: AsyncSession, *, tenant_id: str, response: dict[str, Any],
                         input_items: list[dict[str, Any]], retention_s: float,
                         now: datetime | None = None) -> StoredResponse:
    """Keep `response` (its `id` and `previous_response_id` read from it) and the input items
    of its request, for `retention_s` seconds."""
    now = now or utcnow()
    row = StoredResponse(id=response["id"], tenant_id=tenant_id,
                         previous_response_id=response.get("previous_response_id"),
                         input_items=input_items, response=response, created_at=now,
                         expires_at=now + timedelta(seconds=retention_s))

    async def work() -> StoredResponse:
        session.add(row)
        return row

    return await in_transaction(session, work)


async def get_response(session: AsyncSession, *, response_id: str, tenant_id: str,
                       now: datetime | None = None) -> StoredResponse:
    """`tenant_id`'s live response `response_id`; else NotFound."""
    row = (await session.execute(select(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id,
        StoredResponse.expires_at > (now or utcnow())))).scalar_one_or_none()
    if row is None:
        raise NotFound("response", response_id)
    return row


async def conversation(session: AsyncSession, *, response_id: str, tenant_id: str,
                       now: datetime | None = None) -> list[dict[str, Any]]:
    """The items a response continuing `response_id` follows: the chain's input and output
    items, oldest first. NotFound when `response_id` itself is not live."""
    now = now or utcnow()
    chain = [await get_response(session, response_id=response_id, tenant_id=tenant_id, now=now)]
    while chain[-1].previous_response_id is not None and len(chain) < MAX_CHAIN:
        try:
            chain.append(await get_response(session, response_id=chain[-1].previous_response_id,
                                            tenant_id=tenant_id, now=now))
        except NotFound:
            break
    items: list[dict[str, Any]] = []
    for row in reversed(chain):
        items += row.input_items
        items += row.response.get("output") or []
    return items


async def input_items_page(session: AsyncSession, *, response_id: str, tenant_id: str,
                           after: str | None = None, before: str | None = None, limit: int = 20,
                           order: str = "desc") -> tuple[list[dict[str, Any]], bool]:
    """A page of a response's input items (`desc`: the last first), after the item `after` or
    before the item `before` in that order; and whether more follow."""
    if order not in ("asc", "desc"):
        raise Invalid("order", "must be asc or desc")
    if not 1 <= limit <= 100:
        raise Invalid("limit", "must be in [1, 100]")
    row = await get_response(session, response_id=response_id, tenant_id=tenant_id)
    items = list(row.input_items) if order == "asc" else list(reversed(row.input_items))
    ids = [item.get("id") for item in items]
    start, end = 0, len(items)
    for name, anchor in (("after", after), ("before", before)):
        if anchor is None:
            continue
        if anchor not in ids:
            raise Invalid(name, f"{anchor!r} is not an item of response {response_id!r}")
        if name == "after":
            start = ids.index(anchor) + 1
        else:
            end = ids.index(anchor)
    window = items[start:end]
    return window[:limit], len(window) > limit


async def delete_response(session: AsyncSession, *, response_id: str, tenant_id: str) -> None:
    """Delete `tenant_id`'s live response `response_id`; NotFound if there is none."""
    row = await get_response(session, response_id=response_id, tenant_id=tenant_id)

    async def work() -> None:
        await session.execute(delete(StoredResponse).where(StoredResponse.id == row.id))

    await in_transaction(session, work)


async def sweep_responses(session: AsyncSession, *, now: datetime | None = None) -> int:
    """Delete the responses past their retention; how many went."""
    now = now or utcnow()

    async def work() -> int:
        res = await session.execute(delete(StoredResponse).where(StoredResponse.expires_at <= now))
        return int(res.rowcount or 0)  # type: ignore[attr-defined]

    return await in_transaction(session, work)
