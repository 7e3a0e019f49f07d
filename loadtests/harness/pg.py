"""A PostgreSQL server of a benchmark's own, on its own port, from the machine's PostgreSQL 15
binaries (`initdb`, `pg_ctl`), to stop and start mid-load: the database going down for real.

    with throwaway_postgres() as pg:
        pg.url            # postgresql+asyncpg://postgres@127.0.0.1:PORT/postgres
        pg.stop()         # immediate shutdown: connections refused from now on
        pg.start()        # back, same data
        pg.pause()        # SIGSTOP of every server process: connections open, nothing answers
        pg.resume()       # SIGCONT

As root, the server runs as the `postgres` user (PostgreSQL refuses to run as root). Raises
ServiceUnavailable where the binaries are missing. (The tests use it through
tests/support/throwaway_pg.py, which skips instead.)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lockgate.loadtests.harness.server import free_port
from lockgate.loadtests.harness.services import ServiceUnavailable

BIN = Path(os.environ.get("LOCKGATE_TEST_PG_BIN", "/usr/lib/postgresql/15/bin"))


@dataclass
class ThrowawayPostgres:
    data: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def dsn(self) -> str:
        """The same database for asyncpg itself."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        cmd = [str(BIN / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "-l", str(self.data / "log"), "-o",
                  f"-p {self.port} -k {self.data} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop")

    def _processes(self) -> list[int]:
        """The postmaster (first line of postmaster.pid) and its children, from /proc."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        pids = [postmaster]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                # the field after the parenthesised command name is the state, then the ppid
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == postmaster:
                    pids.append(int(stat.parent.name))
        return pids

    def pause(self) -> None:
        """SIGSTOP the whole server (a hung database): connections stay open, the kernel
        still accepts new ones, and nothing answers until `resume`."""
        for pid in self._processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self._processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def postgres_available() -> bool:
    return (BIN / "initdb").is_file()


@contextlib.contextmanager
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    if not postgres_available():
        raise ServiceUnavailable(f"no PostgreSQL binaries under {BIN} (set LOCKGATE_TEST_PG_BIN)")
    root = Path(tempfile.mkdtemp(prefix="lockgate-pg-"))
    root.chmod(0o755)
    data = root / "data"
    data.mkdir(mode=0o700)
    if os.geteuid() == 0:
        shutil.chown(data, "postgres", "postgres")
    pg = ThrowawayPostgres(data, free_port())
    pg._run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
    pg.start()
    try:
        yield pg
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            pg.stop()
        shutil.rmtree(root, ignore_errors=True)
