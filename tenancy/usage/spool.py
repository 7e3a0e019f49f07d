"""`UsageSpool`: usage rows the database could not take, kept on local disk until it can.

One directory (under the gateway's data directory), two kinds of JSON-lines files, one row a
line:

- `usage-spool.jsonl`, the open spool: rows are appended to it, one batch a write, and the
  batch is fsynced (the file, and the directory when the file is new) before `append`
  returns, so a row acknowledged to a request survives a crash of this process or machine.
- `usage-spool.<ns>.replay.jsonl`: `take()` renames the open spool to one of these (so new
  rows go to a fresh file while it is replayed). The writer inserts its rows (a duplicate
  `request_id` is skipped: replay is idempotent by the rows' unique key), then `done()`
  deletes it. A crash between the insert and the delete replays the file again on the next
  start and duplicates nothing.

A line torn by a crash in the middle of an append (the batch was never acknowledged) is
skipped with a warning. Only `UsageWriter`'s task calls these, one at a time, in a thread.
"""

from __future__ import annotations

import json
import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

OPEN_NAME = "usage-spool.jsonl"
REPLAY_GLOB = "usage-spool.*.replay.jsonl"


def _encode(row: dict[str, Any]) -> bytes:
    out = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in row.items()}
    return json.dumps(out, separators=(",", ":")).encode() + b"\n"


def _decode(line: bytes) -> dict[str, Any]:
    row: dict[str, Any] = json.loads(line)
    if row.get("created_at") is not None:
        row["created_at"] = datetime.fromisoformat(row["created_at"])
    return row


class UsageSpool:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = self.directory / OPEN_NAME
        # rows waiting for the database, this process's and those a previous one left
        self.pending = sum(self._count(p) for p in self._files())

    def _files(self) -> list[Path]:
        replays = sorted(self.directory.glob(REPLAY_GLOB))
        return [*replays, self.path] if self.path.exists() else replays

    @staticmethod
    def _count(path: Path) -> int:
        with path.open("rb") as f:
            return sum(1 for line in f if line.endswith(b"\n"))

    def _sync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def append(self, rows: list[dict[str, Any]]) -> None:
        """Append `rows` to the open spool and fsync them; return once they are on disk."""
        new = not self.path.exists()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, b"".join(_encode(r) for r in rows))
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            self._sync_dir()
        self.pending += len(rows)

    def take(self) -> list[Path]:
        """The files to replay, oldest first; the open spool is renamed to one of them."""
        if self.path.exists():
            self.path.rename(self.directory / f"usage-spool.{time.time_ns()}.replay.jsonl")
            self._sync_dir()
        return sorted(self.directory.glob(REPLAY_GLOB))

    def read(self, path: Path) -> list[dict[str, Any]]:
        rows = []
        with path.open("rb") as f:
            for num, line in enumerate(f, 1):
                try:
                    if not line.endswith(b"\n"):
                        raise ValueError("no newline: torn by a crash mid-append")
                    rows.append(_decode(line))
                except ValueError as exc:
                    logger.warning("usage spool %s line %d skipped: %s", path.name, num, exc)
        return rows

    def done(self, path: Path) -> None:
        """`path`'s rows are in the database: delete it."""
        path.unlink()
        self._sync_dir()
        self.pending = sum(self._count(p) for p in self._files())
