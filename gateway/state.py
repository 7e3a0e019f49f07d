"""`AppState`: the services one gateway process serves with, built whole at start-up and
held in a plain container, each reached by routes through its own dependency (gateway/deps.py);
`Lifecycle` (ready, draining, the admitted runs a shutdown waits for and then cuts)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from sqlalchemy.ext.asyncio import AsyncEngine as DatabaseEngine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from lockgate.gateway.authenticator import Authenticator
from lockgate.gateway.background import Background
from lockgate.gateway.metrics import Metrics
from lockgate.gateway.model_directory import ModelDirectory
from lockgate.gateway.serving.local_admissions import LocalAdmissions
from lockgate.gateway.settings import Settings
from lockgate.gateway.tokenize_pool import TokenizePool
from lockgate.tenancy.limiter import Lease, Limiter
from lockgate.tenancy.usage.refusals import RefusalCounter
from lockgate.tenancy.usage.writer import UsageWriter

logger = logging.getLogger(__name__)


class Cuttable(Protocol):
    def cut(self, reason: str) -> None: ...


@dataclass(slots=True)
class Lifecycle:
    """Whether this process serves: `ready` once start-up has finished, `draining` from the
    shutdown signal on (new requests are then refused with 503), and `runs`, the admitted
    requests not yet ended (`serving.run.RequestRun`s). It exists before the `AppState` does,
    so a signal during start-up is not lost."""

    ready: bool = False
    draining: bool = False
    runs: set[Cuttable] = field(default_factory=set)

    async def drain(self, timeout_s: float, grace_s: float) -> bool:
        """Draining: wait up to `timeout_s` for the runs to end; cut those left (each ends
        with an error to its client and its `cancelled` usage row) and give them `grace_s`
        to write their rows. True when none is left."""
        self.draining = True
        if await self._wait_idle(timeout_s):
            return True
        logger.warning("%d requests still running after %g s of draining: cut", len(self.runs), timeout_s)
        for run in list(self.runs):
            run.cut("shutdown")
        if await self._wait_idle(grace_s):
            return True
        logger.error("%d cut requests had not ended %g s later", len(self.runs), grace_s)
        return False

    async def _wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return not self.runs


@dataclass(slots=True, eq=False)
class AppState:
    """Everything one gateway process serves with. `app.lifespan` builds the parts, then
    this at once, so every service is there from the first request on."""

    settings: Settings
    models: ModelDirectory          # the served models and adapters, as tenants see them
    db: DatabaseEngine
    sessions: async_sessionmaker[AsyncSession]
    limiter: Limiter
    usage: UsageWriter
    auth: Authenticator             # keys -> principals (key cache, lookups, last use)
    lifecycle: Lifecycle
    background: Background
    metrics: Metrics
    tokenize: TokenizePool          # large prompts tokenized off the loop
    refusals: RefusalCounter        # 429s by limit, flushed in batches (app.lifespan)
    # request id -> its lease, counted by scope with the admissions under way (local_admissions)
    inflight: dict[str, Lease] = field(default_factory=LocalAdmissions)

    @property
    def ready(self) -> bool:
        return self.lifecycle.ready

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    @property
    def pepper(self) -> bytes:
        return self.auth.pepper


def app_state(request: Request) -> AppState:
    """The state of the app serving `request` (set by `app.lifespan` before any request)."""
    state: AppState = request.app.state.lockgate
    return state
