"""Usage reports over HTTP (`UsagePublic` as JSON, or CSV), shared by the admin console and a
tenant's own `/v1/usage`."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from gateway.errors import APIError
from gateway.state import AppState
from tenancy.errors import Invalid
from tenancy.usage.report import usage_report

GROUPS = ("day", "model", "service_tier")
CSV_FIELDS = ["group", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
              "total_tokens", "ttft_ms_p50", "ttft_ms_p95"]     # the header of an empty report


class UsagePublic(BaseModel):
    object: str = "list"
    tenant_id: str | None          # None: every tenant
    group_by: str | None
    start: str | None
    end: str | None
    data: list[dict[str, Any]]     # one row per group, as `usage_report` gives it


def parse_time(value: str | None, name: str) -> datetime | None:
    """A query's time: ISO 8601 (naive is UTC) or Unix seconds; 400 naming `name` otherwise."""
    if value in (None, ""):
        return None
    try:
        if value.lstrip("-").replace(".", "", 1).isdigit():
            return datetime.fromtimestamp(float(value), UTC)
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (ValueError, OverflowError, OSError):
        raise APIError(400, f"{name}: expected an ISO 8601 time or Unix seconds, got {value!r}",
                       param=name) from None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


async def usage_response(state: AppState, request: Request, tenant_id: str | None) -> Response:
    """The report the query asks for (start, end, group_by, format), of `tenant_id`'s usage."""
    q = request.query_params
    unknown = set(q) - {"tenant_id", "start", "end", "group_by", "format"}
    if unknown:
        name = sorted(unknown)[0]
        raise APIError(400, f"{name}: unknown query parameter", param=name)
    start, end = parse_time(q.get("start"), "start"), parse_time(q.get("end"), "end")
    if start and end and end < start:
        raise APIError(400, "end: is before start", param="end")
    group_by = q.get("group_by") or None
    if group_by is not None and group_by not in GROUPS:
        raise APIError(400, f"group_by: must be one of {', '.join(GROUPS)}", param="group_by")
    fmt = q.get("format") or "json"
    if fmt not in ("json", "csv"):
        raise APIError(400, "format: must be json or csv", param="format")
    try:
        async with state.sessions() as session:
            rows = await usage_report(session, tenant_id=tenant_id, start=start, end=end,
                                              group_by=group_by)
    except Invalid as exc:
        raise APIError(400, str(exc), param=exc.field) from None
    if fmt == "csv":
        return Response(_csv(rows), media_type="text/csv")
    report = UsagePublic(tenant_id=tenant_id, group_by=group_by,
                         start=start.isoformat() if start else None,
                         end=end.isoformat() if end else None, data=rows)
    return JSONResponse(report.model_dump())


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else CSV_FIELDS)
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()
