"""OpenAI's Files and Batch APIs for a tenant's key: `/v1/files` (upload, list, get, content,
delete) and `/v1/batches` (create, list, get, cancel). The lines run later, in the offline
class, by a replica's `BatchRunner` (gateway/batch_runner.py); here only rows are written.

Another tenant's file or batch answers 404, as one that does not exist. Admins list every
tenant's at `/admin/v1/files` and `/admin/v1/batches` (gateway/admin/batches.py).

Uploads are bounded together as well as one at a time: admitted as any request (the
tenant's rate and concurrency), and a replica takes at most `max_uploads_in_flight` at once,
a tenant at most `max_tenant_uploads_in_flight` on a replica (past either: 429 with
Retry-After, before the body is read; `UploadGate`). An upload's body is never whole in
memory: the multipart parser spools the file to a temporary file (in memory up to
`SPOOL_BYTES`), which is checked (`check_file`, in a thread) and then written to the
database a chunk at a time (`spooled_chunks`); a file's content is read back the same way."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import IO, Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from sqlalchemy.ext.asyncio import AsyncSession
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartParser
from starlette.requests import ClientDisconnect

from lockgate.gateway.deps import SessionDep, StateDep, TenantDep
from lockgate.gateway.errors import APIError
from lockgate.gateway.fields import refuse_nul
from lockgate.gateway.openapi import error_responses
from lockgate.gateway.protocol import read_json
from lockgate.gateway.serving.ticket import admitted
from lockgate.gateway.settings import Settings
from lockgate.tenancy import batches as store
from lockgate.tenancy.errors import NotFound
from lockgate.tenancy.models import FILE_CHUNK_BYTES, Batch, StoredFile

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


# -- uploads: bounded together -------------------------------------------------------------------
SPOOL_BYTES = 256 << 10      # a file part's bytes held in memory before it goes to a temporary file
CHECK_BYTES = 256 << 10      # read (and decoded) at a time by `check_file`


class UploadGate:
    """Uploads in flight on this replica, in all and per tenant."""

    def __init__(self, per_replica: int, per_tenant: int) -> None:
        self.per_replica = per_replica
        self.per_tenant = per_tenant
        self.total = 0
        self.by_tenant: Counter[str] = Counter()

    @contextlib.contextmanager
    def slot(self, tenant_id: str) -> Iterator[None]:
        if self.total >= self.per_replica:
            raise self._refusal(f"This server takes at most {self.per_replica} uploads at once")
        if self.by_tenant[tenant_id] >= self.per_tenant:
            raise self._refusal(f"This tenant may upload at most {self.per_tenant} files at once")
        self.total += 1
        self.by_tenant[tenant_id] += 1
        try:
            yield
        finally:
            self.total -= 1
            self.by_tenant[tenant_id] -= 1
            if not self.by_tenant[tenant_id]:
                del self.by_tenant[tenant_id]

    @staticmethod
    def _refusal(message: str) -> APIError:
        return APIError(429, f"{message}; retry when one has finished.", code="too_many_uploads",
                        headers={"retry-after": "1"})


def upload_gate(request: Request, settings: Settings) -> UploadGate:
    """The app's gate (made on its first upload)."""
    gate: UploadGate | None = getattr(request.app.state, "upload_gate", None)
    if gate is None:
        gate = UploadGate(settings.max_uploads_in_flight, settings.max_tenant_uploads_in_flight)
        request.app.state.upload_gate = gate
    return gate


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"file: larger than {max_bytes} bytes", param="file", code="file_too_large")


def check_file(f: IO[bytes], max_bytes: int, max_lines: int) -> int:
    """The spooled file's size, once it is found UTF-8, non-empty, at most `max_bytes` and
    `max_lines` non-blank lines (each refusal a 4xx naming `file`). Blocking: run it in a
    thread."""
    f.seek(0)
    decoder = codecs.getincrementaldecoder("utf-8")()
    size = lines = 0
    blank = True          # the line being read has nothing but whitespace so far
    while chunk := f.read(CHECK_BYTES):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        try:
            text = decoder.decode(chunk)
        except UnicodeDecodeError as exc:
            raise APIError(400, f"file: not UTF-8 text (byte {size - len(chunk) + exc.start})",
                           param="file") from None
        parts = text.split("\n")
        for part in parts[:-1]:
            lines += not (blank and not part.strip())
            blank = True
        blank = blank and not parts[-1].strip()
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise APIError(400, f"file: not UTF-8 text (byte {size})", param="file") from None
    lines += not blank
    if not lines:
        raise APIError(400, "file: is empty", param="file")
    if lines > max_lines:
        raise APIError(400, f"file: {lines} lines; at most {max_lines} requests per batch file",
                       param="file", code="too_many_lines")
    return size


async def spooled_chunks(f: IO[bytes]) -> AsyncIterator[bytes]:
    """The spooled file, a chunk at a time, each read in a thread."""
    await asyncio.to_thread(f.seek, 0)
    while chunk := await asyncio.to_thread(f.read, FILE_CHUNK_BYTES):
        yield chunk


# -- files ------------------------------------------------------------------------------------------
@router.post("/v1/files", responses=error_responses(400, 401, 403, 413, 415, 429))
async def upload_file(request: Request, principal: TenantDep, state: StateDep, session: SessionDep):
    """Multipart: `purpose` (`batch`), `file` (JSONL, UTF-8, at most `batch_max_lines`
    lines and `max_file_bytes` bytes), optional `expires_after[anchor]`/`[seconds]`. Admitted
    as any request (the tenant's rate and concurrency), and within the caps on uploads in
    flight (`UploadGate`), before its body is read."""
    if not (request.headers.get("content-type") or "").startswith("multipart/form-data"):
        raise APIError(415, "Upload a file as multipart/form-data (fields purpose and file).",
                       param="content-type")
    with upload_gate(request, state.settings).slot(principal.tenant_id or ""):
        async with admitted(state, principal, request) as ticket:
            if ticket.deferred:     # a small body: admitted now all the same, its lease held throughout
                await ticket.reserve(0)
            form = await read_form(request)
            try:
                return await store_upload(form, principal.tenant_id or "", state.settings, session)
            finally:
                await form.close()


async def read_form(request: Request) -> FormData:
    parser = MultiPartParser(request.headers, request.stream(), max_files=1, max_fields=8,
                             max_part_size=64 << 10)
    parser.spool_max_size = SPOOL_BYTES
    try:
        return await parser.parse()
    except ClientDisconnect:
        raise APIError(499, "client closed the request", code="client_closed_request") from None
    except Exception as exc:  # noqa: BLE001 - the multipart parser's own errors are the client's input
        raise APIError(400, f"The multipart body could not be read: {exc}", param="file") from None


async def store_upload(form: FormData, tenant_id: str, s: Settings, session: AsyncSession) -> dict[str, Any]:
    unknown = sorted(k for k in form if k not in FIELDS)
    if unknown:
        raise APIError(400, f"{unknown[0]}: unknown field (expected {', '.join(FIELDS)})", param=unknown[0])
    if form.get("purpose") != "batch":
        raise APIError(400, "purpose: must be 'batch' (the only purpose this server stores)",
                       param="purpose")
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "file: missing (a multipart file part named 'file')", param="file")
    seconds = expires_after(form, "expires_after[anchor]", "expires_after[seconds]")
    size = await asyncio.to_thread(check_file, upload.file, s.max_file_bytes, s.batch_max_lines)
    f = await store.create_file(session, tenant_id=tenant_id, purpose="batch",
                                filename=upload.filename or "upload.jsonl", content=spooled_chunks(upload.file),
                                size=size, expires_after_s=seconds)
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
async def file_content(file_id: str, principal: TenantDep, state: StateDep, session: SessionDep) -> Response:
    f = await store.get_file(session, file_id=file_id, tenant_id=principal.tenant_id)
    return StreamingResponse(file_stream(state, f.id), media_type="application/octet-stream", headers={
        "content-disposition": f'attachment; filename="{f.id}.jsonl"', "content-length": str(f.size)})


async def file_stream(state: StateDep, file_id: str) -> AsyncIterator[bytes]:
    """A file's bytes a chunk at a time, in a session of the stream's own (the route's is
    closed once the route returns)."""
    async with state.sessions() as session:
        async for chunk in store.file_chunks(session, file_id):
            yield chunk


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
