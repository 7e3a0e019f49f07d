"""OpenAI's Files and Batch APIs for a tenant's key: `/v1/files` (upload, list, get, content,
delete) and `/v1/batches` (create, list, get, cancel). The lines run later, in the offline
class, by a replica's `BatchRunner` (gateway/batch_runner.py); here only rows are written.

Another tenant's file or batch answers 404, as one that does not exist. Admins list every
tenant's at `/admin/v1/files` and `/admin/v1/batches` (gateway/admin/batches.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from lockgate.gateway.deps import SessionDep, StateDep, TenantDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.fields import refuse_nul
from lockgate.gateway.openapi import error_responses
from lockgate.gateway.protocol import read_json
from lockgate.tenancy import batches as store
from lockgate.tenancy.errors import NotFound
from lockgate.tenancy.models import Batch, StoredFile

router = APIRouter()
FIELDS = ("purpose", "file", "expires_after[anchor]", "expires_after[seconds]")
EXPIRES_AFTER_S = (3600, 30 * 86400)        # OpenAI's bounds: an hour to 30 days


def ts(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_object(f: StoredFile) -> dict[str, Any]:
    return {"id": f.id, "object": "file", "bytes": f.size, "created_at": ts(f.created_at),
            "expires_at": ts(f.expires_at), "filename": f.filename, "purpose": f.purpose,
            "status": "processed", "status_details": None}


def batch_object(b: Batch, counts: dict[str, int]) -> dict[str, Any]:
    errors = {"object": "list", "data": b.errors} if b.errors else None
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": errors,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window, "status": b.status,
        "output_file_id": b.output_file_id, "error_file_id": b.error_file_id,
        "created_at": ts(b.created_at), "in_progress_at": ts(b.in_progress_at), "expires_at": ts(b.expires_at),
        "finalizing_at": ts(b.finalizing_at), "completed_at": ts(b.completed_at), "failed_at": ts(b.failed_at),
        "expired_at": ts(b.expired_at), "cancelling_at": ts(b.cancelling_at), "cancelled_at": ts(b.cancelled_at),
        "request_counts": {"total": b.total, **counts}, "metadata": b.meta,
        # not OpenAI's: why the batch waits (a limit of its tenant), while it does
        "paused": b.paused,
    }


def page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


async def batch_page(session: Any, rows: list[Batch], has_more: bool) -> dict[str, Any]:
    counts = await store.line_counts(session, [b.id for b in rows])
    return page([batch_object(b, counts[b.id]) for b in rows], has_more)


def expires_after(form: Any, anchor_field: str, seconds_field: str) -> int | None:
    """OpenAI's `expires_after` ({anchor: created_at, seconds}) as seconds, or None."""
    anchor, seconds = form.get(anchor_field), form.get(seconds_field)
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise APIError(400, f"{anchor_field}: must be 'created_at'", param=anchor_field)
    try:
        value = int(seconds)
    except (TypeError, ValueError):
        raise APIError(400, f"{seconds_field}: must be an integer number of seconds",
                       param=seconds_field) from None
    lo, hi = EXPIRES_AFTER_S
    if not lo <= value <= hi:
        raise APIError(400, f"{seconds_field}: must be in [{lo}, {hi}] (an hour to 30 days)",
                       param=seconds_field)
    return value


# -- files ------------------------------------------------------------------------------------------
@router.post("/v1/files", responses=error_responses(400, 401, 403, 413, 415))
async def upload_file(request: Request, principal: TenantDep, state: StateDep, session: SessionDep):
    """Multipart: `purpose` (`batch`), `file` (JSONL, UTF-8, at most `batch_max_lines`
    lines and `max_file_bytes` bytes), optional `expires_after[anchor]`/`[seconds]`."""
    s = state.settings
    if not (request.headers.get("content-type") or "").startswith("multipart/form-data"):
        raise APIError(415, "Upload a file as multipart/form-data (fields purpose and file).",
                       param="content-type")
    try:
        form = await request.form(max_files=1, max_fields=8, max_part_size=64 << 10)
    except Exception as exc:  # noqa: BLE001 - the multipart parser's own errors are the client's input
        raise APIError(400, f"The multipart body could not be read: {exc}", param="file") from None
    try:
        unknown = sorted(k for k in form if k not in FIELDS)
        if unknown:
            raise APIError(400, f"{unknown[0]}: unknown field (expected {', '.join(FIELDS)})", param=unknown[0])
        purpose = form.get("purpose")
        if purpose != "batch":
            raise APIError(400, "purpose: must be 'batch' (the only purpose this server stores)",
                           param="purpose")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file: missing (a multipart file part named 'file')", param="file")
        content = await upload.read(s.max_file_bytes + 1)
        if len(content) > s.max_file_bytes:
            raise APIError(413, f"file: larger than {s.max_file_bytes} bytes", param="file",
                           code="file_too_large")
        if not content.strip():
            raise APIError(400, "file: is empty", param="file")
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(400, f"file: not UTF-8 text (byte {exc.start})", param="file") from None
        lines = sum(1 for ln in text.split("\n") if ln.strip())
        if lines > s.batch_max_lines:
            raise APIError(400, f"file: {lines} lines; at most {s.batch_max_lines} requests per batch file",
                           param="file", code="too_many_lines")
        seconds = expires_after(form, "expires_after[anchor]", "expires_after[seconds]")
        f = await store.create_file(session, tenant_id=principal.tenant_id or "", purpose="batch",
                                    filename=upload.filename or "upload.jsonl", content=content,
                                    expires_after_s=seconds)
    finally:
        await form.close()
    return file_object(f)


@router.get("/v1/files", responses=error_responses(400, 401, 403))
async def list_files(principal: TenantDep, session: SessionDep,
                     purpose: str | None = None, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
                     order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc"):
    rows, more = await store.list_files(session, tenant_id=principal.tenant_id, purpose=purpose,
                                        after=after, limit=limit, order=order)
    return page([file_object(f) for f in rows], more)


@router.get("/v1/files/{file_id}", responses=error_responses(401, 403, 404))
async def get_file(file_id: str, principal: TenantDep, session: SessionDep):
    return file_object(await store.get_file(session, file_id=file_id, tenant_id=principal.tenant_id))


@router.get("/v1/files/{file_id}/content", responses=error_responses(401, 403, 404))
async def file_content(file_id: str, principal: TenantDep, session: SessionDep) -> Response:
    f = await store.get_file(session, file_id=file_id, tenant_id=principal.tenant_id)
    return Response(f.content, media_type="application/octet-stream",
                    headers={"content-disposition": f'attachment; filename="{f.id}.jsonl"'})


@router.delete("/v1/files/{file_id}", responses=error_responses(401, 403, 404))
async def delete_file(file_id: str, principal: TenantDep, session: SessionDep):
    await store.delete_file(session, file_id=file_id, tenant_id=principal.tenant_id)
    return {"id": file_id, "object": "file", "deleted": True}


# -- batches ----------------------------------------------------------------------------------------
@router.post("/v1/batches", responses=error_responses(400, 401, 403, 404, 415))
async def create_batch(request: Request, principal: TenantDep, state: StateDep, session: SessionDep):
    """`input_file_id`, `endpoint`, `completion_window` ("24h"), optional `metadata` and
    `output_expires_after`. The batch runs in the offline class: the tenant's plan must hold
    the `flex` tier."""
    data = await read_json(request)
    known = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise APIError(400, f"{unknown[0]}: unknown field", param=unknown[0])
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not isinstance(data.get(name), str):
            raise APIError(400, f"{name}: required, a string", param=name)
        refuse_nul(data[name], name)      # looked up and stored: PostgreSQL refuses a NUL in text
    if "flex" not in principal.service_tiers:
        raise APIError(403, "A batch runs in the flex tier, which is not in this tenant's plan "
                       f"(allowed: {', '.join(principal.service_tiers)})", param="service_tier",
                       code="service_tier_not_allowed")
    out_exp = data.get("output_expires_after")
    seconds = None
    if out_exp is not None:
        if not isinstance(out_exp, dict):
            raise APIError(400, "output_expires_after: must be an object {anchor, seconds}",
                           param="output_expires_after")
        seconds = expires_after({f"output_expires_after[{k}]": v for k, v in out_exp.items()},
                                "output_expires_after[anchor]", "output_expires_after[seconds]")
    try:
        b = await store.create_batch(
            session, tenant_id=principal.tenant_id or "", api_key_id=principal.key_id,
            input_file_id=data["input_file_id"], endpoint=data["endpoint"],
            completion_window=data["completion_window"], metadata=data.get("metadata"),
            output_expires_after_s=seconds, max_lines=state.settings.batch_max_lines)
    except NotFound:
        raise APIError(404, f"input_file_id: no file {data['input_file_id']!r}", param="input_file_id",
                       code="not_found") from None
    return batch_object(b, (await store.line_counts(session, [b.id]))[b.id])


@router.get("/v1/batches", responses=error_responses(400, 401, 403))
async def list_batches(principal: TenantDep, session: SessionDep, after: str | None = None,
                       limit: Annotated[int, Query(ge=1, le=100)] = 20):
    rows, more = await store.list_batches(session, tenant_id=principal.tenant_id, after=after, limit=limit)
    return await batch_page(session, rows, more)


@router.get("/v1/batches/{batch_id}", responses=error_responses(401, 403, 404))
async def get_batch(batch_id: str, principal: TenantDep, session: SessionDep):
    b = await store.get_batch(session, batch_id=batch_id, tenant_id=principal.tenant_id)
    return batch_object(b, (await store.line_counts(session, [b.id]))[b.id])


@router.post("/v1/batches/{batch_id}/cancel", responses=error_responses(401, 403, 404, 409))
async def cancel_batch(batch_id: str, principal: TenantDep, session: SessionDep):
    b = await store.cancel_batch(session, batch_id=batch_id, tenant_id=principal.tenant_id)
    return batch_object(b, (await store.line_counts(session, [b.id]))[b.id])
