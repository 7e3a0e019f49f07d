"""A redis-server a test starts on its own port, to hang (SIGSTOP) and resume (SIGCONT)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import redis

from tests.support.gateway_server import free_port


class OwnRedis:
    """A redis-server of a test's own on a free port, to SIGSTOP and SIGCONT (a hung Redis)."""

    def __init__(self, tmp_path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        client.close()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        self.proc.wait(10)
