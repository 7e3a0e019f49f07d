"""`lockgate serve`: uvicorn around the app, with a draining shutdown.

SIGTERM or SIGINT: the app starts answering 503 `server_draining` to new requests at once
(`gateway.draining.DrainGate`), on connections old and new: the listening sockets stay open
while the drain lasts, so a client meets a 503 it can act on, never a refused connection.
Admitted requests get `shutdown_timeout_s` to finish; those still running then are cut
(`Lifecycle.drain`): each stream ends with an error event (`server_shutdown`), each JSON
request with a 503, and each writes its one `cancelled` usage row within `shutdown_grace_s`.
Only then does uvicorn stop listening and run its own graceful shutdown (other connections,
`shutdown_grace_s` more), and the app's shutdown close the usage writer and stop the engines.

The address is bound before the app is made: a port another server holds is one line and
exit status 1, before any key is minted or a database made.
"""

from __future__ import annotations

import logging
import socket
import sys
from types import FrameType

import uvicorn

from lockgate.gateway.app import DEMO_MODEL, SchemaBehind, create_app
from lockgate.gateway.http_limits import limited_http
from lockgate.gateway.settings import Settings, parse_model_specs
from lockgate.gateway.state import Lifecycle

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """uvicorn that marks the app draining on the first shutdown signal."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, *, drain_timeout_s: float = 30.0,
                 drain_grace_s: float = 5.0) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self.drain_grace_s = drain_grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.lifecycle.draining = True
        super().handle_exit(sig, frame)
        # a drained shutdown is a clean exit (status 0): uvicorn would otherwise re-raise the
        # signal once stopped, and the process would die of it (-15)
        getattr(self, "_captured_signals", []).clear()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """The admitted requests drained (then cut) while new ones are still answered, 503;
        then uvicorn's own shutdown, which stops listening."""
        await self.lifecycle.drain(self.drain_timeout_s, self.drain_grace_s)
        await super().shutdown(sockets)


def run_server(settings: Settings) -> int:
    """Serve until a signal; the exit status: 0 after a clean shutdown, 2 for a
    configuration error, 1 when start-up failed."""
    # configuration errors: one line, not the traceback of a failed application start-up
    try:
        served = set(parse_model_specs(settings.models)) or {DEMO_MODEL}
        unknown = set(settings.private_models) - served
        if unknown:
            raise ValueError(f"private_models: {sorted(unknown)} are not served models")
    except ValueError as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return 2
    if not settings.embedded and not settings.migrate:
        from lockgate.tenancy import db

        current, head = db.schema_status(settings.resolved_database_url())
        if current != head:
            print(f"lockgate: the database schema is at {current or 'nothing'}, the code needs "
                  f"{head}: run `lockgate db upgrade` or pass --migrate", file=sys.stderr)
            return 2
    try:
        sock = bind(settings.host, settings.port)
    except OSError as exc:
        print(f"lockgate: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc} "
              "(another server holds it? --port or LOCKGATE_PORT picks another)", file=sys.stderr)
        return 1
    with sock:
        return _serve(settings, sock)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) as uvicorn binds one (SO_REUSEADDR: a port whose
    last server's connections linger in TIME_WAIT is free); OSError when it is taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _serve(settings: Settings, sock: socket.socket) -> int:
    from lockgate.engine import AsyncEngine, ProcessEngine

    # the embedded engine (a Ray pool's workers are processes already); `--engine-process` keeps
    # its step loop out of reach of the HTTP loop's GIL
    app = create_app(settings, engine_factory=ProcessEngine if settings.engine_process else AsyncEngine)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=int(max(1, settings.shutdown_grace_s)),
                            lifespan="on", access_log=False,
                            http=limited_http(settings))   # header size, count and deadline
    server = DrainingServer(config, app.state.lifecycle, drain_timeout_s=settings.shutdown_timeout_s,
                            drain_grace_s=settings.shutdown_grace_s)
    try:
        server.run(sockets=[sock])
    except SchemaBehind as exc:
        print(f"lockgate: {exc}", file=sys.stderr)
        return 2
    if not server.started:
        return 1
    return 0
