"""Usage reports over HTTP (`UsagePublic` as JSON, or CSV), shared by the admin console and a
tenant's own `/v1/usage`: `group_by` a comma list of tenant, key, model, service_tier, day;
a page of `limit` groups (default and most `MAX_LIST_LIMIT`) after the cursor `after` (the
`last_id` of the page before; in CSV the `x-last-id` and `x-has-more` headers)."""

from __future__ import annotations

import base64
import binascii
import csv
import io
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from lockgate.gateway.errors import APIError
from lockgate.gateway.state import AppState
from lockgate.tenancy.errors import Invalid
from lockgate.tenancy.usage.report import UsagePage, parse_group_by, usage_page
from lockgate.tenancy.validation import MAX_LIST_LIMIT

CSV_FIELDS = ["requests", "ok", "errors", "cancelled", "prompt_tokens", "cached_tokens",
              "completion_tokens", "total_tokens", "budget_tokens", "ttft_ms_p50", "ttft_ms_p95"]
QUERY = {"tenant_id", "start", "end", "group_by", "format", "limit", "after"}


class UsagePublic(BaseModel):
    object: str = "list"
    tenant_id: str | None          # None: every tenant
    group_by: str | None           # the groups, a comma list; `group` of an entry: None,
    start: str | None              # the value of the one group, or {name: value} of several
    end: str | None
    data: list[dict[str, Any]]     # one row per group, as `usage_page` gives it
    has_more: bool = False         # more groups after this page
    last_id: str | None = None     # the last group's cursor: `after` of the next page


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


def parse_limit(value: str | None, *, default: int = MAX_LIST_LIMIT,
                most: int = MAX_LIST_LIMIT) -> int:
    """A query's page size: 1 to `most`, `default` when absent; 400 naming `limit` otherwise."""
    if value is None or value == "":
        return default
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise APIError(400, f"limit: must be an integer from 1 to {most}", param="limit")
    return int(value)


def encode_cursor(values: list[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(values).encode()).decode().rstrip("=")


def decode_cursor(value: str | None) -> list[str] | None:
    """An `after` cursor (`encode_cursor`'s); 400 naming `after` if it is not one."""
    if value in (None, ""):
        return None
    try:
        values = json.loads(base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)))
    except (ValueError, binascii.Error):
        values = None
    # its values reach the query's WHERE clause: no NUL (PostgreSQL refuses one in text)
    if not isinstance(values, list) or not all(isinstance(v, str) and "\x00" not in v for v in values):
        raise APIError(400, "after: not a cursor of this report (the last_id of a page)",
                       param="after")
    return values


@dataclass(frozen=True, slots=True)
class UsageReport:
    groups: tuple[str, ...]
    page: UsagePage
    start: datetime | None
    end: datetime | None
    last_id: str | None       # the cursor of the page after this one


async def usage_report(state: AppState, q: Mapping[str, str], tenant_id: str | None) -> UsageReport:
    """The report the query `q` asks for (start, end, group_by, limit, after; `format` is
    checked here and honoured by `usage_response`), of `tenant_id`'s usage (None: everyone's)."""
    unknown = set(q) - QUERY
    if unknown:
        name = sorted(unknown)[0]
        raise APIError(400, f"{name}: unknown query parameter", param=name)
    start, end = parse_time(q.get("start"), "start"), parse_time(q.get("end"), "end")
    if start and end and end < start:
        raise APIError(400, "end: is before start", param="end")
    if (q.get("format") or "json") not in ("json", "csv"):
        raise APIError(400, "format: must be json or csv", param="format")
    limit, after = parse_limit(q.get("limit")), decode_cursor(q.get("after"))
    try:
        groups = parse_group_by(q.get("group_by"))
        async with state.sessions() as session:
            page = await usage_page(session, tenant_id=tenant_id, start=start, end=end,
                                    group_by=groups, limit=limit, after=after)
    except Invalid as exc:
        raise APIError(400, str(exc), param=exc.field) from None
    return UsageReport(groups, page, start, end, encode_cursor(page.last) if page.last is not None else None)


async def usage_response(state: AppState, q: Mapping[str, str], tenant_id: str | None) -> Response:
    """`usage_report` as JSON (`UsagePublic`) or CSV: what the admin's and a tenant's routes
    and the console's download answer."""
    r = await usage_report(state, q, tenant_id)
    if (q.get("format") or "json") == "csv":
        headers = {"x-has-more": str(r.page.has_more).lower(), **({"x-last-id": r.last_id} if r.last_id else {})}
        return Response(usage_csv(r.groups, r.page.data), media_type="text/csv", headers=headers)
    report = UsagePublic(tenant_id=tenant_id, group_by=",".join(r.groups) or None,
                         start=r.start.isoformat() if r.start else None,
                         end=r.end.isoformat() if r.end else None, data=r.page.data,
                         has_more=r.page.has_more, last_id=r.last_id)
    return JSONResponse(report.model_dump())


def usage_csv(groups: tuple[str, ...], rows: list[dict[str, Any]]) -> str:
    """One line per entry: its group (one `group` column, or one column per group when there
    are several), then its totals."""
    names = list(groups) if len(groups) > 1 else ["group"]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=names + CSV_FIELDS)
    w.writeheader()
    for r in rows:
        g = r["group"]
        cells = dict(g) if isinstance(g, dict) else {"group": g}
        cells.update((k, v) for k, v in r.items() if k != "group")
        w.writerow({k: ("" if v is None else v) for k, v in cells.items()})
    return buf.getvalue()
