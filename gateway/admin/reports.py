"""/admin/v1/usage (any tenant's or everyone's, JSON or CSV), /admin/v1/quotas/report (each
tenant's and key's limits beside their live use and refusals) and /admin/v1/audit."""

from __future__ import annotations

from fastapi import Request, Response

from lockgate.gateway.admin.route import admin_router
from lockgate.gateway.deps import SessionDep, StateDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.openapi import error_responses
from lockgate.gateway.quota_report import ADMIN_QUERY, QuotaReportPublic, quota_response
from lockgate.gateway.schemas import AuditPagePublic, AuditPublic
from lockgate.gateway.usage_api import UsagePublic, parse_limit, parse_time, usage_response
from lockgate.tenancy.audit import audit_page
from lockgate.tenancy.models import Tenant

router = admin_router()


@router.get("/usage", response_model=UsagePublic)
async def usage(request: Request, state: StateDep, session: SessionDep) -> Response:
    tenant_id = request.query_params.get("tenant_id") or None
    # deleted tenants included: their usage rows are kept for billing
    if tenant_id is not None and await session.get(Tenant, tenant_id) is None:
        raise APIError(404, f"tenant {tenant_id!r} not found", param="tenant_id", code="not_found")
    return await usage_response(state, request, tenant_id)


@router.get("/quotas/report", responses=error_responses(400, 404))
async def quota_report(request: Request, state: StateDep) -> QuotaReportPublic:
    """Every live tenant a page at a time (`limit`, `after`), or `tenant_id`'s alone; the
    refusals over [`start`, `end`) (default: the last 24 h)."""
    return await quota_response(state, request, request.query_params.get("tenant_id") or None,
                                allowed=ADMIN_QUERY)


AUDIT_QUERY = {"limit", "after", "action", "target_type", "target_id", "actor", "start", "end"}


@router.get("/audit", responses=error_responses(400))
async def audit(request: Request, session: SessionDep) -> AuditPagePublic:
    """The newest entries first, a page of `limit` (100; at most 1000) after `after` (the
    `last_id` of the page before; `has_more` says whether there is one), filtered by
    `action`, `target_type`, `target_id`, `actor` and [`start`, `end`). Any other query
    parameter is a 400, not a filter silently ignored."""
    q = request.query_params
    unknown = sorted(set(q) - AUDIT_QUERY)
    if unknown:
        raise APIError(400, f"{unknown[0]}: unknown query parameter (known: "
                       f"{', '.join(sorted(AUDIT_QUERY))})", param=unknown[0])
    limit = parse_limit(q.get("limit"), default=100)
    after = q.get("after") or None
    if after is not None and not (after.isdigit() and len(after) <= 18):
        raise APIError(400, "after: not a cursor of this listing (the last_id of a page)", param="after")
    start, end = parse_time(q.get("start"), "start"), parse_time(q.get("end"), "end")
    rows, has_more = await audit_page(
        session, limit, before_id=int(after) if after else None, action=q.get("action") or None,
        target_type=q.get("target_type") or None, target_id=q.get("target_id") or None,
        actor=q.get("actor") or None, start=start, end=end)
    return AuditPagePublic(data=[AuditPublic.from_row(r) for r in rows], has_more=has_more,
                           last_id=str(rows[-1].id) if rows else None)
