"""`lockgate serve` replicas a benchmark kills with SIGKILL and restarts: each keeps its port
and its data directory across restarts (so a restarted replica replays the usage its killed
process spooled), and each incarnation logs to a file of its own."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from lockgate.loadtests.harness.server import ServerProcess, free_port


def serve_env(*, database_url: str, redis_url: str, redis_prefix: str, pepper: str, admin_key: str,
              engine_kwargs: dict, extra: dict[str, str]) -> dict[str, str]:
    """The environment of a replica: this process's, minus any LOCKGATE_* it has, plus these."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
    env.update({
        "LOCKGATE_DATABASE_URL": database_url, "LOCKGATE_REDIS_URL": redis_url,
        "LOCKGATE_REDIS_PREFIX": redis_prefix, "LOCKGATE_PEPPER": pepper,
        "LOCKGATE_ADMIN_KEY": admin_key, "LOCKGATE_ENGINE_KWARGS": json.dumps(engine_kwargs),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


class ReplicaProcess(ServerProcess):
    name = "lockgate serve (replica)"


@dataclass
class Replica:
    """Replica `index` on `port`: `start()`, `kill()` (SIGKILL, reaped), `start()` again."""

    index: int
    data_dir: Path
    env: dict[str, str]
    models: dict[str, str]
    port: int = field(default_factory=free_port)
    incarnations: int = 0
    server: ReplicaProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> None:
        """A new process on the same port and data directory, ready (`/ready` 200) on return."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**self.env, "LOCKGATE_DATA_DIR": str(self.data_dir)}
        args = [a for name, path in self.models.items() for a in ("--model", f"{name}={path}")]
        log = self.data_dir / f"serve-{self.incarnations}.log"
        self.incarnations += 1
        self.server = ReplicaProcess.launch(("lockgate.gateway.cli", "serve"), env, log, port=self.port,
                                            extra_args=args, timeout=timeout)

    def kill(self) -> None:
        """SIGKILL, and wait until the process is gone (its sockets closed)."""
        if self.server is None:
            return
        proc = self.server.proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def alive(self) -> bool:
        return self.server is not None and self.server.proc.poll() is None

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(timeout=30)
