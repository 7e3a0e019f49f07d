"""The console's read-only pages: the overview (requests, tokens, errors, refusals and TTFT
p50/p99 per service tier and hour over the last 24 h, one SQL statement, drawn as SVG on the
server), usage (grouped, a page at a time, and its CSV: the very answer of
`GET /admin/v1/usage?format=csv` for the same query), the live engine (what /admin/v1/engine
reads, its fragment refreshed by polling) and the audit log (keyset pages)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Request, Response
from fastapi.responses import RedirectResponse

from lockgate.gateway import admin_service as service
from lockgate.gateway.console.charts import colour, line_chart
from lockgate.gateway.console.web import ConsoleRoute, authorize, render, signed_in, url_for
from lockgate.gateway.serving.tiers import TIERS
from lockgate.gateway.state import app_state
from lockgate.gateway.usage_api import CSV_FIELDS, usage_report, usage_response
from lockgate.tenancy.usage.report import GROUPS
from lockgate.tenancy.usage.timeline import timeline

router = APIRouter(route_class=ConsoleRoute, include_in_schema=False)
USAGE_QUERY = ("group_by", "start", "end", "after", "tenant_id")
AUDIT_PAGE = "50"
TIER_OF = {cls: tier for tier, (cls, _) in TIERS.items()}     # the engine's class -> the API's service tier
HOURS = 24
# the overview's charts: (title, Timeline series, unit), one line a service tier
CHARTS = (("Requests", "requests", ""), ("Tokens (prompt + completion)", "tokens", ""),
          ("Errors", "errors", ""), ("Refusals (429s of a limit)", "refusals", ""),
          ("TTFT p50", "ttft_p50", " ms"), ("TTFT p99", "ttft_p99", " ms"))


@router.get("/console", name="console_root")
async def root(request: Request) -> Response:
    return RedirectResponse(url_for(request, "console_overview"), status_code=303)


@router.get("/console/", name="console_overview")
async def overview(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "overview", "view")
    end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end - timedelta(hours=HOURS)
    async with app_state(request).sessions() as session:
        t = await timeline(session, start=start, end=end)
    labels = [h[-2:] + ":00" for h in t.hours]
    charts = [line_chart(title, labels, {tier: t.series(tier, what) for tier in t.tiers}, unit)
              for title, what, unit in CHARTS]
    rows = [{"tier": tier, **{what: t.total(tier, what) for what in ("requests", "tokens", "errors", "refusals")},
             "ttft": t.ttft_ms.get(tier, {})} for tier in t.tiers]
    colours = {tier: colour(tier, i) for i, tier in enumerate(t.tiers)}
    return render(request, "overview.html", user, charts=charts, rows=rows, since=start, colours=colours)


def _usage_query(request: Request) -> dict[str, str]:
    """The usage page's own query, as the API reads it (an empty field is no filter)."""
    q = request.query_params
    return {k: q[k] for k in USAGE_QUERY if q.get(k)}


@router.get("/console/usage", name="console_usage")
async def usage(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "usage", "view")
    query = _usage_query(request)
    query.setdefault("group_by", "tenant")
    report = await usage_report(app_state(request), {**query, "limit": "50"}, query.get("tenant_id"))
    names = list(report.groups) if len(report.groups) > 1 else ["group"]
    rows = [({**r["group"]} if isinstance(r["group"], dict) else {"group": r["group"]}) | r for r in report.page.data]
    return render(request, "usage.html", user, query=query, groups=GROUPS, names=names, fields=CSV_FIELDS,
                  rows=rows, has_more=report.page.has_more, next_after=report.last_id,
                  csv_query={k: v for k, v in query.items() if k != "after"})


@router.get("/console/usage.csv", name="console_usage_csv")
async def usage_csv(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "usage", "download")
    query = _usage_query(request)
    response = await usage_response(app_state(request), {**query, "format": "csv"}, query.get("tenant_id"))
    response.headers["content-disposition"] = 'attachment; filename="lockgate-usage.csv"'
    return response


@router.get("/console/engine", name="console_engine")
async def engine(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "engine", "view")
    return render(request, "engine.html", user, engine=service.engine_snapshot(app_state(request)), tiers=TIER_OF)


@router.get("/console/engine/live", name="console_engine_live")
async def engine_live(request: Request) -> Response:
    """The engine's fragment alone, for the page's poll."""
    user = await signed_in(request)
    authorize(user, "engine", "refresh")
    return render(request, "engine_live.html", user, engine=service.engine_snapshot(app_state(request)),
                  tiers=TIER_OF)


@router.get("/console/audit", name="console_audit")
async def audit(request: Request) -> Response:
    user = await signed_in(request)
    authorize(user, "audit", "view")
    q = request.query_params
    query = {k: q[k] for k in ("after", "action", "actor", "target_id") if q.get(k)}
    async with app_state(request).sessions() as session:
        rows, has_more = await service.audit_listing(session, {**query, "limit": AUDIT_PAGE})
    return render(request, "audit.html", user, rows=rows, query=query,
                  next_after=str(rows[-1].id) if rows and has_more else None)
