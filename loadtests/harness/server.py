"""A server in a subprocess of its own on a free loopback port, ready once `GET /ready` answers
200: `lockgate serve` for the tests and `lockgate bench priority --http`, the instant-engine
gateway for `lockgate bench gateway`."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`python -m <command> --port P ...` with its stdout and stderr in `log_path`."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    name: ClassVar[str] = "the server"        # in error messages
    log_tail: ClassVar[int | None] = 4000     # characters of the log an error quotes (None: all)

    @classmethod
    def launch(cls, command: Sequence[str], env: dict[str, str], log_path: Path, *,
               port: int | None = None, extra_args: Sequence[str] = (), timeout: float = 120.0,
               fields: dict[str, Any] | None = None) -> Self:
        """Start it (on `port`, or a free one) and wait until it is ready; `fields`: the rest
        of a subclass's fields."""
        port = port or free_port()
        args = [sys.executable, "-m", *command, "--port", str(port), *extra_args]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL)
        srv = cls(f"http://127.0.0.1:{port}", proc, log_path, **(fields or {}))
        srv.wait_ready(timeout)
        return srv

    def wait_ready(self, timeout: float) -> None:
        """Poll `/ready` until 200; raise RuntimeError (with the log) if the process exits or
        the time runs out (stopping it then)."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_excerpt()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} was not ready within {timeout:.0f}s:\n{self.log_excerpt()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_excerpt(self) -> str:
        """The log as an error quotes it: its last `log_tail` characters."""
        text = self.log()
        return text if self.log_tail is None else text[-self.log_tail:]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait `timeout` seconds (then kill); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
