"""Uploads to `/v1/files`, bounded together as well as one at a time: a replica takes at most
`max_uploads_in_flight` at once, a tenant at most `max_tenant_uploads_in_flight` on a replica
(past either: 429 with Retry-After, before the body is read; `UploadGate`). An upload's body
is never whole in memory: the multipart parser spools the file to a temporary file (in
memory up to `SPOOL_BYTES`), which is checked (`check_file`) and then written to the
database a chunk at a time (`spooled_chunks`), reading and checking off the event loop."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import IO

from fastapi import Request

from lockgate.gateway.errors import APIError
from lockgate.gateway.settings import Settings
from lockgate.tenancy.models import FILE_CHUNK_BYTES

SPOOL_BYTES = 256 << 10      # a file part's bytes held in memory before it goes to a temporary file


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
    while chunk := f.read(FILE_CHUNK_BYTES):
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
