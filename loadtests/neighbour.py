"""A neighbour for the benches: processes that each burn one core for as long as they run,
started and stopped by the bench (in sessions of their own, so nothing outlives it)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from types import TracebackType


class Neighbours:
    """`with Neighbours(n):` n processes spinning on the CPU inside the block (none for 0)."""

    def __init__(self, count: int) -> None:
        if count < 0:
            raise ValueError(f"neighbour: a count of processes >= 0, got {count}")
        self.count = count
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Neighbours:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                               start_new_session=True))
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        self.procs.clear()
