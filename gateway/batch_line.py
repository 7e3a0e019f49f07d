"""`BatchLineRun`: a Batch API line's run. A `RequestRun` whose usage row names its batch and
is written by the batch runner together with the line's answer (`finish_recorded`, one
transaction), and which, when its result will never be seen (its replica stops or loses the
batch, the engine refused a prompt at submit), ends with no row and its admission cancelled
(`abandon`): the line is retried or answered as an error, and nothing counts twice."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

from lockgate.gateway.model_directory import ModelEntry
from lockgate.gateway.serving.job import RunInputs
from lockgate.gateway.serving.run import RequestRun
from lockgate.gateway.serving.ticket import Ticket
from lockgate.tenancy.usage.writer import UsageRow

logger = logging.getLogger(__name__)


class BatchLineRun(RequestRun):
    def __init__(self, ticket: Ticket, entry: ModelEntry, tier: str, inputs: RunInputs, batch_id: str) -> None:
        super().__init__(ticket, entry, tier, inputs)
        self.batch_id = batch_id

    def _usage_row(self, status: str, now: float) -> UsageRow:
        return dataclasses.replace(super()._usage_row(status, now), batch_id=self.batch_id)

    async def _refused_at_submit(self) -> None:
        """A prompt the engine refused at submit ran nothing: no row, not counted (the line is
        retried or answered as an error)."""
        await self.abandon()

    async def finish_recorded(self, status: str, record: Callable[[UsageRow], Awaitable[bool]]) -> bool:
        """End the run (instead of `finish`) with its usage row written by `record`, which
        commits it together with the caller's own result and says whether it did (a batch's
        line: False when the line was answered already). The lease is settled to the row
        when it was written, cancelled otherwise (nothing billed, nothing counted); if
        `record` raises, the lease is cancelled and the error passed on. False after another end."""
        if self._ended is not None:
            return False
        self._ended = asyncio.get_running_loop().create_future()
        written = False
        try:
            self._close_streams()
            now = time.time()
            self.usage = self.usage_dict(status)
            try:
                written = await record(self._usage_row(status, now))
            except BaseException:
                # the row may have been committed after all (a timeout after the commit): the
                # lease is left to lapse, and the reconciler settles it to the row, or refunds it
                if self.lease is not None:
                    self.state.inflight.pop(self.id, None)
                    self.lease = None
                raise
            if written:
                self._count(status, now)
        finally:
            await self._release_lease(self._billed_tokens(status) if written else None)
            self._left()
        return written

    async def abandon(self) -> None:
        """End the run with no usage row and its admission cancelled (no rate, lease or
        budget keeps it): work whose result nobody will see and that will be run again (a
        batch's line when its replica stops or loses the batch). A no-op after another end."""
        if self._ended is not None:
            return
        self._ended = asyncio.get_running_loop().create_future()
        try:
            self._close_streams()
        finally:
            await self._release_lease(None)
            self._left()
