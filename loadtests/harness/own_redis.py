"""A redis-server of a benchmark's own on a free loopback port, to hang (SIGSTOP) and resume
(SIGCONT), or to lose (`restart`: kill -9, then a fresh empty one on the same port). (The tests
use it too, through tests/support/own_redis.py.)"""

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
        self.server = server
        self.work_dir = work_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._start()

    def _start(self) -> None:
        """Start redis-server on `port` and wait (10 s at most) until it answers a PING."""
        import redis

        self.proc = subprocess.Popen(
            [self.server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.work_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung Redis)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def restart(self) -> None:
        """kill -9 the server, then start a fresh one on the same port: every key is gone (no
        persistence), as after a crash; clients' connections break and must reconnect."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._start()

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(10)
