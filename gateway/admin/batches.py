"""/admin/v1/files and /admin/v1/batches: every tenant's files and batches (or one tenant's),
newest first, paginated as the tenant routes are; an admin may cancel any batch."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query

from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.batch_api import batch_object, batch_page, file_object, page
from lockgate.gateway.deps import SessionDep
from lockgate.tenancy import batches as store

router = admin_router()


@router.get("/files")
async def list_files(session: SessionDep, tenant_id: str | None = None, purpose: str | None = None,
                     after: str | None = None, limit: Annotated[int, Query(ge=1, le=10_000)] = 100):
    rows, more = await store.list_files(session, tenant_id=tenant_id, purpose=purpose, after=after, limit=limit)
    return page([file_object(f) for f in rows], more)


@router.get("/batches")
async def list_batches(session: SessionDep, tenant_id: str | None = None, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20):
    rows, more = await store.list_batches(session, tenant_id=tenant_id, after=after, limit=limit)
    return await batch_page(session, rows, more)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, session: SessionDep):
    b = await store.cancel_batch(session, batch_id=batch_id, tenant_id=None)
    return batch_object(b, (await store.line_counts(session, [b.id]))[b.id])
