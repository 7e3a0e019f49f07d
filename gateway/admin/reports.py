"""/admin/v1/usage (any tenant's or everyone's, JSON or CSV) and /admin/v1/audit."""

from __future__ import annotations

from typing import Annotated

from fastapi import Query, Request, Response

from gateway.admin.route import admin_router
from gateway.deps import SessionDep, StateDep
from gateway.errors import APIError
from gateway.schemas import AuditPublic, ListPublic
from gateway.usage_api import UsagePublic, usage_response
from tenancy.audit import list_audit
from tenancy.models import Tenant

router = admin_router()


@router.get("/usage", response_model=UsagePublic)
async def usage(request: Request, state: StateDep, session: SessionDep) -> Response:
    tenant_id = request.query_params.get("tenant_id") or None
    # deleted tenants included: their usage rows are kept for billing
    if tenant_id is not None and await session.get(Tenant, tenant_id) is None:
        raise APIError(404, f"tenant {tenant_id!r} not found", param="tenant_id", code="not_found")
    return await usage_response(state, request, tenant_id)


@router.get("/audit")
async def audit(session: SessionDep, limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> ListPublic[AuditPublic]:
    rows = await list_audit(session, limit=limit)
    return ListPublic[AuditPublic](data=[AuditPublic.from_row(r) for r in rows])
