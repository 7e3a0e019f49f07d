"""Shared fixtures of the gateway's route tests: the app in this process (no server process,
no port), one per test module, its lifespan run for the module's life.

- `gateway`: on both backends in turn ("embedded": SQLite + the in-process limiter;
  "services": PostgreSQL + Redis), with the fake served engine (tests/support/
  fake_served_engine.py): for route behaviour (validation, auth, errors, shapes, streaming,
  usage rows, limits).
- `model_gateway`: the real engine (`AsyncEngine`) on the tiny demo model, embedded: for
  what the model writes (greedy tokens, logprobs, structured outputs, tool calls).
- `tenant`: a tenant of `gateway` and its key, made once per module.

A module sets what its gateway is built with in `GATEWAY_OPTIONS` / `MODEL_GATEWAY_OPTIONS`
(keyword arguments of tests/support/inprocess_gateway.py's `running_gateway`: `models`,
`engine_kwargs`, any `Settings` field), and runs its tests in the module's event loop, the
one its gateway lives in:

    pytestmark = pytest.mark.asyncio(loop_scope="module")

A module that needs something else (one backend, a Redis of its own) writes its own fixture
around `running_gateway`. Subprocess servers (tests/support/gateway_server.py) are for what
needs the process itself: signals, kills, replicas, uvicorn's limits, the command line.
"""

from __future__ import annotations

import pytest_asyncio

from tests.support.inprocess_gateway import InProcessGateway, running_gateway


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=["embedded", "services"])
async def gateway(request, tmp_path_factory) -> InProcessGateway:
    options = getattr(request.module, "GATEWAY_OPTIONS", {})
    async with running_gateway(tmp_path_factory.mktemp(request.param), request.param, engine="fake",
                               **options) as gw:
        yield gw


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def model_gateway(request, tmp_path_factory) -> InProcessGateway:
    options = getattr(request.module, "MODEL_GATEWAY_OPTIONS", {})
    async with running_gateway(tmp_path_factory.mktemp("model"), "embedded", engine="real",
                               **options) as gw:
        yield gw


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tenant(gateway) -> tuple[dict, str]:
    return await gateway.tenant()
