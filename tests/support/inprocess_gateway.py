"""The gateway in this process, for route tests: `create_app(settings, engine_factory=...)`,
its lifespan run for the context's life, and clients that call it through the ASGI
interface (tests/support/asgi_transport.py: answers streamed, a client can leave).

    async with running_gateway(tmp_dir, "embedded" | "services", engine="fake" | "real") as gw:
        t, key = await gw.tenant(quota={...})
        r = await gw.openai(key).chat.completions.create(...)
        r = await gw.http.post("/v1/completions", headers=gw.auth(key), json={...})
        await gw.admin.get("/engine")            # /admin/v1, with the admin key

Backends, as tests/support/gateway_server.py's: "embedded" (SQLite in the data directory,
the in-process limiter), "services" (a fresh PostgreSQL database, migrated at start, and
Redis under a key prefix of its own, both dropped afterwards), and "postgresql" (that
database, or the `database_url` given, with the in-process limiter).

Engines: "fake" (tests/support/fake_served_engine.py's FakeServedEngine: no model runs; for
route behaviour), "real" (`AsyncEngine`, the default factory, on a small KV cache: for what
the model writes), or any engine factory. `gw.engines` holds each engine made.

A subprocess server (`GatewayServer`) is for what needs the process itself: signals, a
kill, several replicas, uvicorn's own limits, the command line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai

from lockgate.engine import AsyncEngine
from lockgate.gateway.app import create_app
from lockgate.gateway.settings import Settings
from tests.support.asgi_transport import StreamingASGITransport
from tests.support.fake_served_engine import FakeServedEngine
from tests.support.helpers import demo_model

__all__ = ["REAL_ENGINE_KWARGS", "InProcessGateway", "LogCapture", "running_gateway"]

BASE_URL = "http://test"
# the real engine's: a small KV cache (what `GatewayServer` gives its subprocess servers)
REAL_ENGINE_KWARGS = {"kv_cache_memory": 32 << 20, "max_num_seqs": 64}


class LogCapture(logging.Handler):
    """Every log record of the process while it is installed, formatted as `lockgate serve`
    logs them (`... LEVEL logger: message`); `level` lowers the root logger's level too (as
    `lockgate -v serve` does), and that of each of `loggers` (those that set their own, as
    SQLAlchemy's do), for the capture's life."""

    def __init__(self, level: int | None = None, loggers: tuple[str, ...] = ()) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.buffer = io.StringIO()
        self.root_level = level
        self.loggers = ("", *loggers) if level is not None else ()
        self._saved: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.buffer.write(self.format(record) + "\n")
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is the logger's bug, not the test's
            self.handleError(record)

    def text(self) -> str:
        return self.buffer.getvalue()

    def __enter__(self) -> LogCapture:
        logging.getLogger().addHandler(self)
        for name in self.loggers:
            logger = logging.getLogger(name)
            self._saved[name] = logger.level
            logger.setLevel(self.root_level)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)
        for name, level in self._saved.items():
            logging.getLogger(name).setLevel(level)


@dataclass
class InProcessGateway:
    app: Any
    settings: Settings
    backend: str
    admin_key: str
    transport: StreamingASGITransport
    http: httpx.AsyncClient             # no key: pass `headers=gw.auth(key)`
    admin: httpx.AsyncClient            # /admin/v1 with the admin key
    engines: list = field(default_factory=list)
    logs: LogCapture | None = None
    url: str = BASE_URL

    @property
    def data_dir(self) -> Path:
        return self.settings.data_dir

    @property
    def database_url(self) -> str:
        return self.settings.resolved_database_url()

    @property
    def engine(self) -> Any:
        """The one engine (a module serving one model)."""
        assert len(self.engines) == 1, self.engines
        return self.engines[0]

    @staticmethod
    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def client(self, key: str | None = None, **kw: Any) -> httpx.AsyncClient:
        """Another client of this app (its own headers, base URL or timeout)."""
        kw.setdefault("base_url", self.url)
        kw.setdefault("timeout", 60)
        if key is not None:
            kw["headers"] = {**self.auth(key), **kw.get("headers", {})}
        return httpx.AsyncClient(transport=self.transport, **kw)

    def openai(self, key: str, **kw: Any) -> openai.AsyncOpenAI:
        """The official client on this app: no retries, a 60 s timeout unless given."""
        kw.setdefault("timeout", 60)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                                  http_client=self.http, **kw)

    async def tenant(self, name: str | None = None, **fields: Any) -> tuple[dict, str]:
        """A new tenant and an inference key for it: (tenant json, key)."""
        name = name or "t-" + secrets.token_hex(4)
        r = await self.admin.post("/tenants", json={"name": name, **fields})
        assert r.status_code == 201, r.text
        t = r.json()
        r = await self.admin.post(f"/tenants/{t['id']}/keys", json={"name": "k"})
        assert r.status_code == 201, r.text
        return t, r.json()["key"]

    def log(self) -> str:
        return self.logs.text() if self.logs is not None else ""


def _factory(engine: str | Callable[..., Any], made: list) -> Callable[..., Any]:
    if engine == "fake":
        return FakeServedEngine.factory(made)
    if engine == "real":
        engine = AsyncEngine
    assert callable(engine), engine

    def make(*args: Any, **kwargs: Any) -> Any:
        made.append(engine(*args, **kwargs))
        return made[-1]
    return make


@contextlib.asynccontextmanager
async def running_gateway(
    data_dir: Path,
    backend: str = "embedded",
    *,
    engine: str | Callable[..., Any] = "fake",
    models: dict[str, str] | None = None,
    private_models: tuple[str, ...] = (),
    engine_kwargs: dict[str, Any] | None = None,
    admin_key: str | None = None,
    log_level: int | None = None,
    log_loggers: tuple[str, ...] = (),
    umask: int | None = None,
    **settings: Any,
) -> AsyncIterator[InProcessGateway]:
    """The app on `backend`, started (its lifespan entered) and stopped afterwards. `settings`:
    any other `Settings` field (`database_url`, `redis_url`... given, they win over the
    backend's own). `log_level`: capture the process's logs from this level (`gw.log()`), the
    loggers `log_loggers` (which set their own level) lowered to it too.
    `umask`: the process's umask while the app starts (what it creates must not follow it)."""
    from tests.support.services import check_redis, drop_redis_prefix, fresh_pg_database

    models = models if models is not None else {"tiny": demo_model("llama", "tiny", 0)}
    admin_key = admin_key or "lg-" + secrets.token_urlsafe(32)
    if engine_kwargs is None:
        engine_kwargs = dict(REAL_ENGINE_KWARGS) if engine in ("real", AsyncEngine) else {}
    made: list = []
    async with contextlib.AsyncExitStack() as stack:
        if backend in ("postgresql", "services"):
            url = settings.pop("database_url", None) or stack.enter_context(fresh_pg_database())
            settings = {"database_url": url, "pepper": secrets.token_hex(32), "migrate": True, **settings}
        if backend == "services":
            prefix = f"lgtest:{os.getpid()}:{secrets.token_hex(4)}:"
            settings = {"redis_url": check_redis(), "redis_prefix": prefix, **settings}
            stack.callback(drop_redis_prefix, prefix)
        elif backend not in ("embedded", "postgresql"):
            raise ValueError(f"backend: 'embedded', 'postgresql' or 'services', not {backend!r}")
        data_dir.mkdir(parents=True, exist_ok=True)
        s = Settings(data_dir=data_dir, admin_key=admin_key, engine_kwargs=engine_kwargs,
                     models=[f"{name}={path}" for name, path in models.items()],
                     private_models=list(private_models), **settings)
        app = create_app(s, engine_factory=_factory(engine, made))
        logs = (stack.enter_context(LogCapture(log_level, log_loggers)) if log_level is not None
                else None)
        old = os.umask(umask) if umask is not None else None
        try:
            await stack.enter_async_context(app.router.lifespan_context(app))
        finally:
            if old is not None:
                os.umask(old)
        transport = StreamingASGITransport(app)
        http = httpx.AsyncClient(transport=transport, base_url=BASE_URL, timeout=60)
        stack.push_async_callback(http.aclose)
        admin = httpx.AsyncClient(transport=transport, base_url=BASE_URL + "/admin/v1", timeout=60,
                                  headers={"Authorization": f"Bearer {admin_key}"})
        stack.push_async_callback(admin.aclose)
        yield InProcessGateway(app=app, settings=s, backend=backend, admin_key=admin_key,
                               transport=transport, http=http, admin=admin, engines=made, logs=logs)
