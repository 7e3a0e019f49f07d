"""`lockgate serve`'s app in a process of its own, on the fake engine (tests/support/
fake_served_engine.py), for tests where the process's own event loop is the point (a flood
that keeps it busy) and a model's compute would only be in the way. Settings come from
`LOCKGATE_*` variables, as `lockgate serve`'s do; `FAKE_ENGINE_TOKEN_INTERVAL_S` paces the
fake engine's tokens. uvicorn runs as `lockgate serve` runs it (no access log).

    python -m tests.support.fake_engine_server --port 8123
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from lockgate.gateway.app import create_app
from lockgate.gateway.settings import Settings
from tests.support.fake_served_engine import FakeServedEngine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args = ap.parse_args(argv)
    interval = float(os.environ.get("FAKE_ENGINE_TOKEN_INTERVAL_S", "0"))
    app = create_app(Settings(), engine_factory=FakeServedEngine.factory(token_interval_s=interval))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="on",
                            access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
