"""A live `lockgate serve` for tests: a real process on a loopback port, real uvicorn.

    srv = GatewayServer.start(tmp_dir, backend="embedded" | "services", ...)
    srv.url, srv.admin_key, srv.admin (an httpx.Client with the admin key)
    srv.stop()   # SIGTERM, then waits

Backends: "embedded" (SQLite + the in-process limiter) and "services" (PostgreSQL + Redis,
given as URLs). Two servers given the same URLs and pepper are two replicas.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.helpers import demo_model

ENGINE_KWARGS = {"kv_cache_memory": 32 << 20, "max_num_seqs": 64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class GatewayServer:
    url: str
    proc: subprocess.Popen
    admin_key: str
    data_dir: Path
    log_path: Path
    env: dict = field(default_factory=dict)
    _admin: httpx.Client | None = None

    @classmethod
    def start(
        cls,
        data_dir: Path,
        *,
        database_url: str | None = None,
        redis_url: str | None = None,
        redis_prefix: str | None = None,
        pepper: str | None = None,
        admin_key: str | None = None,
        models: dict[str, str] | None = None,
        private_models: tuple[str, ...] = (),
        extra_env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        timeout: float = 120.0,
    ) -> GatewayServer:
        data_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        admin_key = admin_key or "lg-" + secrets.token_urlsafe(32)
        models = models if models is not None else {"tiny": demo_model("llama", "tiny", 0)}
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
        env.update({
            "LOCKGATE_DATA_DIR": str(data_dir),
            "LOCKGATE_ADMIN_KEY": admin_key,
            "LOCKGATE_ENGINE_KWARGS": json.dumps(ENGINE_KWARGS),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        })
        if database_url:
            env["LOCKGATE_DATABASE_URL"] = database_url
        if redis_url:
            env["LOCKGATE_REDIS_URL"] = redis_url
        if redis_prefix:
            env["LOCKGATE_REDIS_PREFIX"] = redis_prefix
        if pepper:
            env["LOCKGATE_PEPPER"] = pepper
        env.update(extra_env or {})
        args = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)]
        for name, path in models.items():
            args += ["--model", f"{name}={path}"]
        for name in private_models:
            args += ["--private-model", name]
        if database_url:
            args.append("--migrate")
        args += extra_args or []
        log_path = data_dir / f"server-{port}.log"
        log = open(log_path, "wb")
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parents[2])
        srv = cls(f"http://127.0.0.1:{port}", proc, admin_key, data_dir, log_path, env)
        srv.wait_ready(timeout)
        return srv

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lockgate serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"lockgate serve not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def admin(self) -> httpx.Client:
        if self._admin is None:
            self._admin = httpx.Client(base_url=self.url + "/admin/v1", timeout=30,
                                       headers={"Authorization": f"Bearer {self.admin_key}"})
        return self._admin

    def tenant(self, name: str | None = None, **fields) -> tuple[dict, str]:
        """A new tenant and an inference key for it: (tenant json, key)."""
        name = name or "t-" + secrets.token_hex(4)
        r = self.admin.post("/tenants", json={"name": name, **fields})
        assert r.status_code == 201, r.text
        t = r.json()
        r = self.admin.post(f"/tenants/{t['id']}/keys", json={"name": "k"})
        assert r.status_code == 201, r.text
        return t, r.json()["key"]

    def stop(self, timeout: float = 60.0) -> int:
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def running_server(tmp_dir: Path, backend: str, **kwargs):
    """A server on `backend` ("embedded" or "services"), stopped afterwards."""
    from tests.support.services import check_redis, drop_redis_prefix, fresh_pg_database

    if backend == "embedded":
        srv = GatewayServer.start(tmp_dir, **kwargs)
        try:
            yield srv
        finally:
            srv.stop()
        return
    redis_url = check_redis()
    prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
    with fresh_pg_database() as url:
        srv = GatewayServer.start(tmp_dir, database_url=url, redis_url=redis_url,
                                  redis_prefix=prefix, pepper=secrets.token_hex(32), **kwargs)
        try:
            yield srv
        finally:
            srv.stop()
            drop_redis_prefix(prefix)
