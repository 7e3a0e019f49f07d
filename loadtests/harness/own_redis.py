"""A redis-server of a benchmark's own on a free loopback port, to hang (SIGSTOP) and resume
(SIGCONT). (The tests use it too, through tests/support/own_redis.py.)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from lockgate.loadtests.harness.server import free_port
from lockgate.loadtests.harness.services import ServiceUnavailable


class OwnRedis:
    """`redis-server` on a free port, no persistence, its files under `work_dir`."""

    def __init__(self, work_dir: Path) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise ServiceUnavailable("no redis-server on PATH")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._args = [server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                      "--appendonly", "no", "--dir", str(work_dir)]
        self._launch()

    def _launch(self) -> None:
        import redis

        self.proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        self.stop()
                        raise ServiceUnavailable(f"redis-server on port {self.port} did not start") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def restart(self) -> None:
        """SIGKILL, then a fresh redis-server on the same port: Redis lost with all its data
        (no persistence) and back empty. Clients' connections break and must reconnect."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._launch()

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung Redis)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(10)
