"""The Batch API's rows: files (their bytes in the database, so that any replica serves them),
batches and their lines. Keyword-only async functions over a session, each change one
transaction; the gateway's `BatchRunner` drives a batch through them. The input file's lines
are read by `batch_input.parse_input`, which needs no database.

A batch's life, as OpenAI's: `validating` (created; its lines stored) -> `in_progress` (a
replica holds its lease and runs its pending lines) -> `finalizing` (every line answered;
the output and error files written) -> `completed`; or `cancelling` -> `cancelled`, or
`expired` once its completion window passed, both with the lines answered so far; or
`failed` when the input file as a whole is unusable (empty, not UTF-8, too many lines).

Exactly once: a line becomes `done` or `error` only if it is still `pending`, in the same
transaction as its usage row (`finish_line`). A replica that dies mid-line leaves it pending
(and its limiter admission to the reconciler); whoever holds the lease next runs it again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterable, AsyncIterator
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, case, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from lockgate.tenancy.batch_input import check_metadata, parse_input
from lockgate.tenancy.db import in_transaction
from lockgate.tenancy.errors import Conflict, Invalid, NotFound
from lockgate.tenancy.models import (
    FILE_CHUNK_BYTES,
    FILE_PURPOSES,
    Batch,
    BatchLine,
    FileChunk,
    StoredFile,
    UsageRecord,
    new_batch_id,
    new_file_id,
    utcnow,
)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
FINAL = ("failed", "completed", "expired", "cancelled")
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


# -- files ------------------------------------------------------------------------------------------
async def create_file(session: AsyncSession, *, tenant_id: str, purpose: str, filename: str,
                      content: bytes | AsyncIterable[bytes], size: int | None = None,
                      expires_after_s: int | None = None) -> StoredFile:
    """A file of `content` (its bytes, or its chunks as they are read: `size` then says how
    many), written a chunk at a time in one transaction."""
    if purpose not in FILE_PURPOSES:
        raise Invalid("purpose", f"must be one of {list(FILE_PURPOSES)}")
    if isinstance(content, bytes):
        size = len(content)
    now = utcnow()
    row = StoredFile(id=new_file_id(), tenant_id=tenant_id, purpose=purpose,
                     filename=(filename or "upload.jsonl")[:256], size=size or 0, content=None,
                     created_at=now,
                     expires_at=now + timedelta(seconds=expires_after_s) if expires_after_s else None)

    async def work() -> StoredFile:
        await _add_file(session, row, content)
        return row

    return await in_transaction(session, work)


async def _add_file(session: AsyncSession, row: StoredFile, content: bytes | AsyncIterable[bytes]) -> None:
    """`row` and its chunks (core inserts, one chunk held at a time; the caller commits)."""
    session.add(row)
    await session.flush()
    seq = 0
    async for chunk in _chunked(content):
        await session.execute(insert(FileChunk).values(file_id=row.id, seq=seq, data=chunk))
        seq += 1


async def _chunked(content: bytes | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(content, bytes):
        for at in range(0, len(content), FILE_CHUNK_BYTES):
            yield content[at:at + FILE_CHUNK_BYTES]
        return
    async for chunk in content:
        if chunk:
            yield chunk


async def file_chunks(session: AsyncSession, file_id: str) -> AsyncIterator[bytes]:
    """A file's bytes, a chunk (one query) at a time; a file stored before the chunks
    existed, whole."""
    seq = 0
    while True:
        data = (await session.execute(select(FileChunk.data).where(
            FileChunk.file_id == file_id, FileChunk.seq == seq))).scalar_one_or_none()
        if data is None:
            break
        yield data
        seq += 1
    if seq == 0:
        legacy = (await session.execute(select(StoredFile.content).where(StoredFile.id == file_id))
                  ).scalar_one_or_none()
        if legacy:
            yield legacy


async def file_bytes(session: AsyncSession, file_id: str) -> bytes:
    return b"".join([chunk async for chunk in file_chunks(session, file_id)])


def _live_file(now: datetime) -> Any:
    return or_(StoredFile.expires_at.is_(None), StoredFile.expires_at > now)


async def get_file(session: AsyncSession, *, file_id: str, tenant_id: str | None) -> StoredFile:
    """A file of `tenant_id` (any tenant's for None, the admin), not expired; else NotFound
    (another tenant's file is indistinguishable from none)."""
    conds = [StoredFile.id == file_id, _live_file(utcnow())]
    if tenant_id is not None:
        conds.append(StoredFile.tenant_id == tenant_id)
    row = (await session.execute(select(StoredFile).where(*conds).options(defer(StoredFile.content)))
           ).scalar_one_or_none()
    if row is None:
        raise NotFound("file", file_id)
    return row


async def list_files(session: AsyncSession, *, tenant_id: str | None, purpose: str | None = None,
                     after: str | None = None, limit: int = 20, order: str = "desc",
                     ) -> tuple[list[StoredFile], bool]:
    """A page of files (without their bytes loaded), newest first by default; and whether
    more follow."""
    conds: list[Any] = [_live_file(utcnow())]
    if tenant_id is not None:
        conds.append(StoredFile.tenant_id == tenant_id)
    if purpose is not None:
        conds.append(StoredFile.purpose == purpose)
    return await _page(session, StoredFile, conds, after, limit, order, tenant_id)


async def delete_file(session: AsyncSession, *, file_id: str, tenant_id: str | None) -> None:
    row = await get_file(session, file_id=file_id, tenant_id=tenant_id)

    async def work() -> None:
        await session.execute(delete(StoredFile).where(StoredFile.id == row.id))

    await in_transaction(session, work)


async def _page(session: AsyncSession, model: Any, conds: list[Any], after: str | None, limit: int,
                order: str, tenant_id: str | None) -> tuple[list[Any], bool]:
    if order not in ("asc", "desc"):
        raise Invalid("order", "must be asc or desc")
    if not 1 <= limit <= 10_000:
        raise Invalid("limit", "must be in [1, 10000]")
    key = (model.created_at, model.id)
    if after is not None:
        anchor_conds = [model.id == after]
        if tenant_id is not None:
            anchor_conds.append(model.tenant_id == tenant_id)
        anchor = (await session.execute(select(model.created_at, model.id).where(*anchor_conds))).first()
        if anchor is None:
            raise Invalid("after", f"{after!r} is not one of the listed ids")
        t, i = anchor
        if order == "desc":
            conds.append(or_(model.created_at < t, and_(model.created_at == t, model.id < i)))
        else:
            conds.append(or_(model.created_at > t, and_(model.created_at == t, model.id > i)))
    ordering = [k.desc() for k in key] if order == "desc" else list(key)
    stmt = select(model).where(*conds).order_by(*ordering).limit(limit + 1)
    if model is StoredFile:
        stmt = stmt.options(defer(StoredFile.content))
    rows = list((await session.execute(stmt)).scalars().all())
    return rows[:limit], len(rows) > limit


async def sweep_files(session: AsyncSession, *, now: datetime | None = None) -> int:
    """Delete the files whose time is up (their bytes with them); how many went."""
    now = now or utcnow()

    async def work() -> int:
        res = await session.execute(delete(StoredFile).where(StoredFile.expires_at <= now))
        return int(res.rowcount or 0)  # type: ignore[attr-defined]

    return await in_transaction(session, work)


# -- batches ----------------------------------------------------------------------------------------
async def create_batch(session: AsyncSession, *, tenant_id: str, api_key_id: str, input_file_id: str,
                       endpoint: str, completion_window: str, metadata: Any = None,
                       output_expires_after_s: int | None = None, max_lines: int) -> Batch:
    """A batch of `tenant_id`'s file `input_file_id` (purpose `batch`), its lines stored with
    it, in `validating`; or a `failed` batch naming why, when the file cannot be read."""
    if endpoint not in ENDPOINTS:
        raise Invalid("endpoint", f"must be one of {list(ENDPOINTS)}")
    if completion_window not in COMPLETION_WINDOWS:
        raise Invalid("completion_window", f"must be one of {list(COMPLETION_WINDOWS)}")
    meta = check_metadata(metadata)
    f = await get_file(session, file_id=input_file_id, tenant_id=tenant_id)
    if f.purpose != "batch":
        raise Invalid("input_file_id", f"file {input_file_id!r} has purpose {f.purpose!r}; a batch's "
                                       "input must have purpose 'batch'")
    now = utcnow()
    batch = Batch(id=new_batch_id(), tenant_id=tenant_id, api_key_id=api_key_id, endpoint=endpoint,
                  input_file_id=input_file_id, completion_window=completion_window, status="validating",
                  meta=meta, total=0, output_expires_s=output_expires_after_s, created_at=now,
                  expires_at=now + COMPLETION_WINDOWS[completion_window])
    try:       # tens of thousands of lines: off the event loop
        content = await file_bytes(session, f.id)
        lines = await asyncio.to_thread(parse_input, content, endpoint=endpoint, max_lines=max_lines)
    except Invalid as exc:
        batch.status, batch.failed_at = "failed", now
        batch.errors = [{"code": "invalid_file", "message": exc.message, "param": "input_file_id",
                         "line": None}]
        lines = []
    batch.total = len(lines)

    async def work() -> Batch:
        session.add(batch)
        await session.flush()
        if lines:
            await session.execute(insert(BatchLine), [
                {"batch_id": batch.id, "line": ln.line, "custom_id": ln.custom_id, "body": ln.body,
                 "status": "error" if ln.error else "pending", "error": ln.error} for ln in lines])
        return batch

    return await in_transaction(session, work)


async def get_batch(session: AsyncSession, *, batch_id: str, tenant_id: str | None) -> Batch:
    conds = [Batch.id == batch_id]
    if tenant_id is not None:
        conds.append(Batch.tenant_id == tenant_id)
    row = (await session.execute(select(Batch).where(*conds).execution_options(populate_existing=True))
           ).scalar_one_or_none()
    if row is None:
        raise NotFound("batch", batch_id)
    return row


async def list_batches(session: AsyncSession, *, tenant_id: str | None, after: str | None = None,
                       limit: int = 20) -> tuple[list[Batch], bool]:
    conds: list[Any] = []
    if tenant_id is not None:
        conds.append(Batch.tenant_id == tenant_id)
    return await _page(session, Batch, conds, after, limit, "desc", tenant_id)


async def line_counts(session: AsyncSession, batch_ids: list[str]) -> dict[str, dict[str, int]]:
    """Per batch: lines done (`completed`) and in error (`failed`)."""
    if not batch_ids:
        return {}
    stmt = (select(BatchLine.batch_id,
                   func.sum(case((BatchLine.status == "done", 1), else_=0)),
                   func.sum(case((BatchLine.status == "error", 1), else_=0)))
            .where(BatchLine.batch_id.in_(batch_ids)).group_by(BatchLine.batch_id))
    out = {b: {"completed": 0, "failed": 0} for b in batch_ids}
    for b, done, err in (await session.execute(stmt)).all():
        out[b] = {"completed": int(done or 0), "failed": int(err or 0)}
    return out


async def cancel_batch(session: AsyncSession, *, batch_id: str, tenant_id: str | None) -> Batch:
    """Ask a batch to stop: `cancelling` (its runner answers no more lines and finalizes it as
    `cancelled`); a no-op on one already cancelling or cancelled; Conflict once it ended."""
    batch = await get_batch(session, batch_id=batch_id, tenant_id=tenant_id)
    if batch.status in ("cancelling", "cancelled"):
        return batch
    if batch.status not in ("validating", "in_progress"):
        raise Conflict("status", f"batch {batch_id!r} is {batch.status}; only a validating or "
                                 "in-progress batch can be cancelled")

    async def work() -> Batch:
        now = utcnow()
        res = await session.execute(update(Batch).where(
            Batch.id == batch_id, Batch.status.in_(("validating", "in_progress")))
            .values(status="cancelling", cancelling_at=now))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            raise Conflict("status", f"batch {batch_id!r} ended meanwhile")
        return batch

    await in_transaction(session, work)
    return await get_batch(session, batch_id=batch_id, tenant_id=tenant_id)


# -- the runner's side ------------------------------------------------------------------------------
async def claim_batches(session: AsyncSession, *, owner: str, ttl_s: float, limit: int,
                        exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Up to `limit` active batches whose lease is free or lapsed, or still `owner`'s, now
    leased to `owner` (oldest first), none of `exclude` (those `owner` works already). Each
    claim is a compare-and-set, so two replicas never hold one batch. A batch `owner` leases
    but does not work (its round failed with the database, and so did handing it back) is
    taken up again at once rather than after its own lease lapses."""
    now = utcnow()
    free = or_(Batch.lease_owner.is_(None), Batch.lease_expires_at < now, Batch.lease_owner == owner)
    conds = [Batch.status.in_(ACTIVE), free]
    if exclude:
        conds.append(Batch.id.notin_(sorted(exclude)))
    ids = (await session.execute(select(Batch.id).where(*conds)
                                 .order_by(Batch.created_at).limit(limit))).scalars().all()
    claimed = []
    for batch_id in ids:
        res = await session.execute(update(Batch).where(Batch.id == batch_id, Batch.status.in_(ACTIVE), free)
                                    .values(lease_owner=owner, lease_expires_at=now + timedelta(seconds=ttl_s)))
        await session.commit()
        if res.rowcount == 1:  # type: ignore[attr-defined]
            claimed.append(batch_id)
    return claimed


async def renew_lease(session: AsyncSession, *, batch_id: str, owner: str, ttl_s: float) -> bool:
    """Extend `owner`'s lease; False if it is no longer `owner`'s (lapsed and taken)."""
    res = await session.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner)
                                .values(lease_expires_at=utcnow() + timedelta(seconds=ttl_s)))
    await session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]


async def release_lease(session: AsyncSession, *, batch_id: str, owner: str) -> None:
    await session.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner)
                          .values(lease_owner=None, lease_expires_at=None))
    await session.commit()


async def set_status(session: AsyncSession, *, batch_id: str, owner: str, status: str,
                     paused: str | None = None, only_from: tuple[str, ...] = ACTIVE) -> bool:
    """Move `owner`'s batch to `status` (its time stamped); False if not `owner`'s or not in
    `only_from`."""
    values: dict[str, Any] = {"status": status, "paused": paused}
    stamp = {"in_progress": "in_progress_at", "finalizing": "finalizing_at", "completed": "completed_at",
             "expired": "expired_at", "cancelled": "cancelled_at", "failed": "failed_at"}.get(status)
    if stamp:
        values[stamp] = utcnow()
    res = await session.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner,
                                                    Batch.status.in_(only_from)).values(**values))
    await session.commit()
    return res.rowcount == 1  # type: ignore[attr-defined]


async def set_paused(session: AsyncSession, *, batch_id: str, owner: str, paused: str | None) -> None:
    await session.execute(update(Batch).where(Batch.id == batch_id, Batch.lease_owner == owner)
                          .values(paused=paused[:256] if paused else None))
    await session.commit()


async def pending_lines(session: AsyncSession, *, batch_id: str, limit: int,
                        skip: set[int]) -> list[BatchLine]:
    stmt = (select(BatchLine).where(BatchLine.batch_id == batch_id, BatchLine.status == "pending")
            .order_by(BatchLine.line).limit(limit + len(skip)))
    rows = (await session.execute(stmt)).scalars().all()
    return [r for r in rows if r.line not in skip][:limit]


async def finish_line(session: AsyncSession, *, batch_id: str, line: int, status: str,
                      status_code: int | None, response: dict[str, Any] | None,
                      error: dict[str, Any] | None, request_id: str | None,
                      usage: dict[str, Any] | None) -> bool:
    """Answer a pending line and, in the same transaction, insert its usage row (`usage`,
    the row's values); False, with nothing written, if the line was answered already."""
    if status not in ("done", "error"):
        raise Invalid("status", "must be done or error")

    async def work() -> bool:
        res = await session.execute(update(BatchLine).where(
            BatchLine.batch_id == batch_id, BatchLine.line == line, BatchLine.status == "pending")
            .values(status=status, status_code=status_code, response=response, error=error,
                    request_id=request_id))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            return False
        if usage is not None:
            await session.execute(insert(UsageRecord).values(**usage))
        return True

    return await in_transaction(session, work)


async def error_pending(session: AsyncSession, *, batch_id: str, code: str, message: str) -> int:
    """Every still-pending line answered with `error` (the batch expired or was cancelled)."""
    res = await session.execute(update(BatchLine).where(
        BatchLine.batch_id == batch_id, BatchLine.status == "pending")
        .values(status="error", error={"code": code, "message": message}))
    await session.commit()
    return int(res.rowcount or 0)  # type: ignore[attr-defined]


def _output_line(batch_id: str, ln: BatchLine) -> dict[str, Any]:
    return {"id": f"batch_req_{batch_id[6:]}_{ln.line}", "custom_id": ln.custom_id,
            "response": ln.response, "error": ln.error}


async def write_results(session: AsyncSession, *, batch: Batch, owner: str, final_status: str,
                        only_from: tuple[str, ...] = ACTIVE) -> bool:
    """The output file (lines answered 200) and the error file (the rest answered), then the
    batch in `final_status`, in one transaction; False if `owner` lost the lease meanwhile or
    the batch is no longer in one of `only_from` (a cancel came first)."""
    lines = (await session.execute(select(BatchLine).where(
        BatchLine.batch_id == batch.id, BatchLine.status.in_(("done", "error")))
        .order_by(BatchLine.line))).scalars().all()

    def render() -> tuple[list[str], list[str]]:
        return ([json.dumps(_output_line(batch.id, ln)) for ln in lines if ln.status == "done"],
                [json.dumps(_output_line(batch.id, ln)) for ln in lines if ln.status == "error"])

    ok, bad = await asyncio.to_thread(render)       # tens of thousands of lines: off the event loop
    now = utcnow()
    expires = now + timedelta(seconds=batch.output_expires_s) if batch.output_expires_s else None

    def file_row(kind: str, rows: list[str]) -> tuple[StoredFile, bytes]:
        content = ("\n".join(rows) + "\n").encode()
        return StoredFile(id=new_file_id(), tenant_id=batch.tenant_id, purpose="batch_output",
                          filename=f"{batch.id}_{kind}.jsonl", size=len(content), content=None,
                          created_at=now, expires_at=expires), content

    async def work() -> bool:
        files = {kind: file_row(kind, rows) for kind, rows in (("output", ok), ("error", bad)) if rows}
        out, err = (files[k][0] if k in files else None for k in ("output", "error"))
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}[final_status]
        res = await session.execute(update(Batch).where(Batch.id == batch.id, Batch.lease_owner == owner,
                                                        Batch.status.in_(only_from))
                                    .values(status=final_status, output_file_id=out.id if out else None,
                                            error_file_id=err.id if err else None, paused=None,
                                            lease_owner=None, lease_expires_at=None, **{stamp: now}))
        if res.rowcount != 1:  # type: ignore[attr-defined]
            return False
        for f, content in files.values():
            await _add_file(session, f, content)
        return True

    return await in_transaction(session, work)


async def usage_rows_of(session: AsyncSession, *, batch_id: str) -> list[UsageRecord]:
    return list((await session.execute(select(UsageRecord).where(UsageRecord.batch_id == batch_id)))
                .scalars().all())
