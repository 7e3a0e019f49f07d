"""A live `lockgate serve` for tests: a real process on a loopback port, real uvicorn. For
what needs the process itself (signals, a kill, several replicas, uvicorn's limits, the
command line); route tests run the app in process (tests/support/inprocess_gateway.py).

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
import subprocess  # noqa: F401 - tests patch gateway_server.subprocess.Popen (the launch's)
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lockgate.loadtests.harness.server import ServerProcess, free_port
from tests.support.helpers import demo_model

__all__ = ["ENGINE_KWARGS", "GatewayServer", "free_port", "running_server"]

ENGINE_KWARGS = {"kv_cache_memory": 32 << 20, "max_num_seqs": 64}


@dataclass
class GatewayServer(ServerProcess):
    admin_key: str
    data_dir: Path
    env: dict = field(default_factory=dict)
    _admin: httpx.Client | None = None

    name = "lockgate serve"
    log_tail = None

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
        args: list[str] = []
        for name, path in models.items():
            args += ["--model", f"{name}={path}"]
        for name in private_models:
            args += ["--private-model", name]
        if database_url:
            args.append("--migrate")
        args += extra_args or []
        return cls.launch(("lockgate.gateway.cli", "serve"), env, data_dir / f"server-{port}.log", port=port,
                          extra_args=args, timeout=timeout,
                          fields={"admin_key": admin_key, "data_dir": data_dir, "env": env})

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
        return super().stop(timeout)


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
