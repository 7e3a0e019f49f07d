"""/admin/v1/usage (any tenant's or everyone's, JSON or CSV), /admin/v1/quotas/report (each
tenant's and key's limits beside their live use and refusals) and /admin/v1/audit."""

from __future__ import annotations

from fastapi import Request, Response

from lockgate.gateway import admin_service
from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.deps import SessionDep, StateDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.openapi import error_responses
from lockgate.gateway.quota_report import ADMIN_QUERY, QuotaReportPublic, quota_response
from lockgate.gateway.schemas import AuditPagePublic, AuditPublic
from lockgate.gateway.usage_api import UsagePublic, usage_response
from lockgate.tenancy.models import Tenant

router = admin_router()


@router.get("/usage", response_model=UsagePublic)
async def usage(request: Request, state: StateDep, session: SessionDep) -> Response:
    tenant_id = request.query_params.get("tenant_id") or None
    # deleted tenants included: their usage rows are kept for billing
    if tenant_id is not None and await session.get(Tenant, tenant_id) is None:
        raise APIError(404, f"tenant {tenant_id!r} not found", param="tenant_id", code="not_found")
    return await usage_response(state, request.query_params, tenant_id)


@router.get("/quotas/report", responses=error_responses(400, 404))
async def quota_report(request: Request, state: StateDep) -> QuotaReportPublic:
    """Every live tenant a page at a time (`limit`, `after`), or `tenant_id`'s alone; the
    refusals over [`start`, `end`) (default: the last 24 h)."""
    return await quota_response(state, request.query_params, request.query_params.get("tenant_id") or None,
                                allowed=ADMIN_QUERY)


@router.get("/audit", responses=error_responses(400))
async def audit(request: Request, session: SessionDep) -> AuditPagePublic:
    """The newest entries first, a page of `limit` (100; at most 1000) after `after` (the
    `last_id` of the page before; `has_more` says whether there is one), filtered by
    `action`, `target_type`, `target_id`, `actor` and [`start`, `end`). Any other query
    parameter is a 400, not a filter silently ignored."""
    rows, has_more = await admin_service.audit_listing(session, request.query_params)
    return AuditPagePublic(data=[AuditPublic.from_row(r) for r in rows], has_more=has_more,
                           last_id=str(rows[-1].id) if rows else None)
