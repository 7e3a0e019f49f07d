"""`BatchRunner`: one per gateway process, in its own task. It leases batches from the
database (one replica works a batch at a time; a dead replica's batches are taken over once
their lease lapses) and runs their pending lines through the same path as an HTTP request:
the tenant's key as it stands now, its limits, the engine's offline class (the `flex` tier),
one usage row per line tagged with the batch.

- A line's answer and its usage row are one transaction (`tenancy.batches.finish_line`): a
  line answered twice (two replicas after a lapsed lease) keeps the first, and the second
  run's admission is cancelled, so usage is counted exactly once.
- A limit that refuses a line (rate, budget, concurrency) pauses the batch: no new lines
  start, the refused one retries every `batch_pause_poll_s` with the key's quotas read
  afresh, so raising a budget resumes it. An engine at its queue bound is waited out the
  same way: batch lines are never shed, only held back.
- Lines in flight when the replica drains, or loses the lease, are abandoned (no usage row,
  admission cancelled) and stay pending for whoever runs the batch next.
- Every database call is bounded (`database_timeout_s`, through the sessions); a failure
  leaves the line pending and the runner retries on its next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from datetime import UTC, datetime
from typing import Any

from lockgate.gateway import structured
from lockgate.gateway.batch_line import BatchLineRun
from lockgate.gateway.errors import APIError
from lockgate.gateway.protocol import (
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingBody,
)
from lockgate.gateway.serving.chat import chat_job
from lockgate.gateway.serving.completion import completion_job
from lockgate.gateway.serving.job import Job, JobMaker
from lockgate.gateway.serving.prepare import prepare
from lockgate.gateway.serving.ticket import Ticket
from lockgate.gateway.serving.tiers import RunCut
from lockgate.gateway.state import AppState
from lockgate.gateway.tokenize_pool import TokenizerError
from lockgate.tenancy import batches as store
from lockgate.tenancy import stored_responses
from lockgate.tenancy.auth import Principal, principal_of_key
from lockgate.tenancy.errors import AuthError
from lockgate.tenancy.models import Batch, BatchLine, escape_nul
from lockgate.tenancy.usage.writer import UsageRow

logger = logging.getLogger(__name__)

ENDPOINTS: dict[str, tuple[type[SamplingBody], tuple[str, ...], JobMaker]] = {
    "/v1/chat/completions": (ChatCompletionRequest, UNSUPPORTED_CHAT, chat_job),
    "/v1/completions": (CompletionRequest, UNSUPPORTED_COMPLETION, completion_job),
}
TRANSIENT = (429, 503)          # a limit, the engine's queue bound, a busy tokenizer: wait, retry
MAX_FAILURES = 5                # unforeseen failures of one line before it is answered as an error


class Retry(Exception):
    """The line could not start now (`reason`); try again after `after_s`."""

    def __init__(self, reason: str, after_s: float, paused: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.after_s = after_s
        self.paused = paused        # a limit of the tenant's: the batch pauses


def retry_after(exc: APIError, default: float) -> float:
    try:
        return max(0.05, min(default, float(exc.headers.get("retry-after", default))))
    except (TypeError, ValueError):
        return default


class BatchRunner:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.settings = state.settings
        self.owner = f"{socket.gethostname()[:32]}:{os.getpid()}:{secrets.token_hex(4)}"
        self.active: dict[str, asyncio.Task[None]] = {}
        self.paused: dict[str, str] = {}
        self.slots = asyncio.Semaphore(self.settings.batch_max_inflight)
        self._principals: dict[str, tuple[float, Principal]] = {}
        self._last_sweep = 0.0
        self._last_renew = 0.0

    # -- the loop ---------------------------------------------------------------------------------
    async def run(self) -> None:
        """Forever: renew the leases held, claim free batches, sweep expired files and stored
        responses (the Responses API's, past their retention)."""
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("batch runner round failed", exc_info=True)
            await asyncio.sleep(self.settings.batch_poll_s)

    async def tick(self) -> None:
        s = self.settings
        if self.state.draining:
            await self.stop()
            return
        now = time.monotonic()
        if now - self._last_renew >= s.batch_lease_ttl_s / 3:
            self._last_renew = now
            for batch_id in list(self.active):
                try:
                    async with self.state.sessions() as session:
                        held = await store.renew_lease(session, batch_id=batch_id, owner=self.owner,
                                                       ttl_s=s.batch_lease_ttl_s)
                except Exception:  # the database failed now: retried next round, the lease still runs
                    logger.warning("batch %s: lease not renewed", batch_id, exc_info=True)
                    self._last_renew = 0.0
                    continue
                if not held and batch_id in self.active:
                    logger.warning("batch %s: lease lost; its lines in flight are abandoned", batch_id)
                    self.active.pop(batch_id).cancel()
        # a batch paused by its tenant's limit holds no place: others are taken meanwhile
        free = s.batch_max_active - len(set(self.active) - set(self.paused))
        if free > 0:
            async with self.state.sessions() as session:
                claimed = await store.claim_batches(session, owner=self.owner, ttl_s=s.batch_lease_ttl_s,
                                                    limit=free, exclude=set(self.active))
            for batch_id in claimed:
                logger.info("batch %s: taken by %s", batch_id, self.owner)
                self.active[batch_id] = asyncio.get_running_loop().create_task(self.work(batch_id))
        if now - self._last_sweep >= s.file_sweep_interval_s:
            self._last_sweep = now
            async with self.state.sessions() as session:
                gone = await store.sweep_files(session)
                responses = await stored_responses.sweep_responses(session)
            if gone or responses:
                logger.info("%d expired files and %d expired responses deleted", gone, responses)

    async def stop(self) -> None:
        """Abandon every line in flight and hand the batches back (their leases released,
        so another replica takes them at once)."""
        tasks = list(self.active.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.active.clear()

    # -- one batch --------------------------------------------------------------------------------
    async def work(self, batch_id: str) -> None:
        inflight: dict[int, asyncio.Task[None]] = {}
        s = self.settings
        try:
            while True:
                async with self.state.sessions() as session:
                    batch = await store.get_batch(session, batch_id=batch_id, tenant_id=None)
                if batch.lease_owner != self.owner:
                    await self._cancel_lines(inflight)      # taken over: its lines are the holder's
                    return
                if batch.status == "validating":
                    async with self.state.sessions() as session:
                        await store.set_status(session, batch_id=batch_id, owner=self.owner,
                                               status="in_progress", only_from=("validating",))
                    continue
                ending = self._ending(batch)
                if ending is not None:
                    await self._cancel_lines(inflight)
                    if await self._end(batch, *ending):
                        return
                    continue
                for n in [n for n, t in inflight.items() if t.done()]:
                    inflight.pop(n)
                lines: list[BatchLine] = []
                # the replica's lines shared among the batches it works, so that one big
                # batch does not keep the others' lines out of the engine's fair queue
                room = max(1, s.batch_max_inflight // max(1, len(self.active))) - len(inflight)
                if room > 0 and batch_id not in self.paused and not self.state.draining:
                    async with self.state.sessions() as session:
                        lines = await store.pending_lines(session, batch_id=batch_id, limit=room,
                                                          skip=set(inflight))
                if not lines and not inflight and batch_id not in self.paused and not self.state.draining:
                    if await self._end(batch, "completed", None):
                        return
                    continue        # cancelled (or taken) meanwhile: look again
                for ln in lines:
                    inflight[ln.line] = asyncio.get_running_loop().create_task(self.run_line(batch, ln))
                waiters: list[asyncio.Future[Any]] = list(inflight.values())
                if waiters:
                    await asyncio.wait(waiters, timeout=s.batch_poll_s, return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(s.batch_poll_s)
        except asyncio.CancelledError:
            await self._cancel_lines(inflight)
            with contextlib.suppress(Exception):
                async with self.state.sessions() as session:
                    await store.release_lease(session, batch_id=batch_id, owner=self.owner)
            raise
        except Exception:
            logger.warning("batch %s: round failed; handed back", batch_id, exc_info=True)
            await self._cancel_lines(inflight)
            with contextlib.suppress(Exception):
                async with self.state.sessions() as session:
                    await store.release_lease(session, batch_id=batch_id, owner=self.owner)
        finally:
            self.paused.pop(batch_id, None)
            if self.active.get(batch_id) is asyncio.current_task():
                self.active.pop(batch_id, None)

    def _ending(self, batch: Batch) -> tuple[str, str] | None:
        if batch.status == "cancelling":
            return "cancelled", "batch_cancelled"
        if batch.expires_at <= datetime.now(UTC):
            return "expired", "batch_expired"
        return None

    async def _cancel_lines(self, inflight: dict[int, asyncio.Task[None]]) -> None:
        tasks = list(inflight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        inflight.clear()

    async def _end(self, batch: Batch, status: str, code: str | None) -> bool:
        """Answer what is left (cancelled or expired lines, as errors), write the output
        and error files and end the batch in `status`; False if it could not (a cancel came
        first, or the lease went), and the caller looks at the batch again."""
        async with self.state.sessions() as session:
            if code is not None:
                await store.error_pending(session, batch_id=batch.id, code=code,
                                          message=f"the batch was {status} before this line ran")
                only_from: tuple[str, ...] = store.ACTIVE
            else:
                await store.set_status(session, batch_id=batch.id, owner=self.owner, status="finalizing",
                                       only_from=("in_progress",))
                only_from = ("finalizing",)     # a cancel that came meanwhile wins
            done = await store.write_results(session, batch=batch, owner=self.owner, final_status=status,
                                             only_from=only_from)
        logger.info("batch %s: %s%s", batch.id, status, "" if done else " not yet (its state moved)")
        return done

    # -- one line ---------------------------------------------------------------------------------
    async def principal(self, key_id: str) -> Principal:
        """The key's principal as it stands (quotas and plan read afresh every
        `key_cache_ttl_s`)."""
        hit = self._principals.get(key_id)
        if hit is not None and time.monotonic() - hit[0] < self.settings.key_cache_ttl_s:
            return hit[1]
        async with self.state.sessions() as session:
            p = await principal_of_key(session, key_id)
        self._principals[key_id] = (time.monotonic(), p)
        return p

    async def run_line(self, batch: Batch, ln: BatchLine) -> None:
        """Run one line until it is answered (retrying while it cannot start; an unforeseen
        failure `MAX_FAILURES` times in a row answers it as an error)."""
        failures = 0
        while True:
            try:
                await self.attempt(batch, ln)
            except Retry as r:
                if r.paused and self.paused.get(batch.id) != r.reason:
                    self.paused[batch.id] = r.reason
                    await self._set_paused(batch.id, r.reason)
                await asyncio.sleep(r.after_s)
                continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a database or engine failure: the line stays pending
                failures += 1
                logger.warning("batch %s line %d failed (%d of %d)", batch.id, ln.line, failures,
                               MAX_FAILURES, exc_info=True)
                if failures >= MAX_FAILURES:
                    with contextlib.suppress(Exception):
                        await self._refused(batch, ln, APIError(
                            500, f"The line failed {failures} times: {type(exc).__name__}: {exc}",
                            code="internal_error"), f"{batch.id}-{ln.line}")
                    return
                await asyncio.sleep(self.settings.batch_pause_poll_s)
                continue
            if self.paused.pop(batch.id, None) is not None:
                await self._set_paused(batch.id, None)
            return

    async def _set_paused(self, batch_id: str, reason: str | None) -> None:
        with contextlib.suppress(Exception):
            async with self.state.sessions() as session:
                await store.set_paused(session, batch_id=batch_id, owner=self.owner, paused=reason)

    async def _answer(self, batch: Batch, ln: BatchLine, status: str, code: int | None,
                      response: dict | None, error: dict | None, request_id: str | None,
                      usage: UsageRow | None) -> bool:
        async with self.state.sessions() as session:
            return await store.finish_line(session, batch_id=batch.id, line=ln.line, status=status,
                                           status_code=code, response=response, error=error,
                                           request_id=request_id,
                                           usage=usage.values() if usage is not None else None)

    async def _refused(self, batch: Batch, ln: BatchLine, exc: APIError, request_id: str) -> None:
        """An answer that is not a 200 and ran nothing: the error file's line (no usage)."""
        await self._answer(batch, ln, "error", exc.status,
                           {"status_code": exc.status, "request_id": request_id, "body": exc.body()},
                           None, request_id, None)

    async def attempt(self, batch: Batch, ln: BatchLine) -> None:
        s = self.settings
        request_id = f"{batch.id}-{ln.line}-{secrets.token_hex(4)}"
        try:
            principal = await self.principal(batch.api_key_id)
        except AuthError as exc:
            if exc.reason == "tenant_suspended":     # may come back: wait, as for a limit
                raise Retry("the tenant is suspended", s.batch_pause_poll_s, paused=True) from None
            await self._refused(batch, ln, APIError(401, f"The batch's API key can no longer be used "
                                                         f"({exc.reason}).", code="invalid_api_key"),
                                request_id)
            return
        model, unsupported, make_job = ENDPOINTS[batch.endpoint]
        async with self.slots:
            ticket = Ticket(self.state, principal, request_id, time.time(), None, count_refusals=False)
            try:
                req, entry, tier = await prepare(self.state.models, s, principal, ln.body or {}, model, unsupported,
                                                 tier="flex")
                structured.grammar_owner.set(principal.tenant_id or "default")   # its grammars' cache share
                job = await make_job(s, self.state.tokenize, req, entry)
            except TokenizerError as exc:
                raise Retry(f"tokenizer busy: {exc}", 1.0, paused=False) from None
            except APIError as exc:
                if exc.status in TRANSIENT:
                    raise Retry(exc.message, retry_after(exc, s.batch_pause_poll_s), paused=False) from None
                await self._refused(batch, ln, exc, request_id)
                return
            run = BatchLineRun(ticket, entry, tier, job.inputs, batch.id)
            # the usage row's copy (a text column): NUL escaped, as the line's own is stored
            run.client_request_id = escape_nul(ln.custom_id)[:128] if ln.custom_id else None
            try:
                await run.admit()
            except APIError as exc:
                never = exc.status == 429 and "retry-after" not in exc.headers
                if exc.status in TRANSIENT and not never:    # a limit that can never pass: an error line
                    raise Retry(f"{exc.code}: {exc.message}", s.batch_pause_poll_s,
                                paused=exc.status == 429) from None
                await self._refused(batch, ln, exc, request_id)
                return
            await self._run(batch, ln, job, run, req.model, request_id)

    async def _run(self, batch: Batch, ln: BatchLine, job: Job, run: BatchLineRun, model: str,
                   request_id: str) -> None:
        try:
            try:
                await run.submit(sheddable=False)
            except APIError as exc:
                if exc.status in TRANSIENT:     # the engine's queue bound: held back, never shed
                    raise Retry(f"engine busy: {exc.message}", retry_after(exc, 1.0), paused=False) from None
                await self._refused(batch, ln, exc, request_id)
                return
            async for _ in run.events():
                pass
        except RunCut as cut:
            if self.state.draining or not run.finals:
                # stopping, or cut by request_timeout_s before it ran (a long queue): run it again
                await asyncio.shield(run.abandon())
                if self.state.draining:
                    raise asyncio.CancelledError from None
                raise Retry("waited request_timeout_s in the engine's queue", 0.0, paused=False) from None
            await asyncio.shield(run.finish_recorded("cancelled", self._recorder(batch, ln, cut.status, {
                "status_code": cut.status, "request_id": request_id, "body": cut.body()}, request_id)))
            return
        except APIError as exc:
            # the engine stopped under it: nothing delivered, so nothing billed; run again later
            await asyncio.shield(run.abandon())
            raise Retry(f"engine: {exc.message}", retry_after(exc, self.settings.batch_pause_poll_s),
                        paused=False) from None
        except asyncio.CancelledError:
            await asyncio.shield(run.abandon())
            raise
        except BaseException:
            await asyncio.shield(run.abandon())
            raise

        def answer() -> dict:
            return {"status_code": 200, "request_id": request_id, "body": job.body(run, model, run.tier)}

        written = await asyncio.shield(run.finish_recorded("ok", self._recorder(batch, ln, 200, answer, request_id)))
        if not written:
            logger.info("batch %s line %d was answered elsewhere first; this run not counted", batch.id, ln.line)

    def _recorder(self, batch: Batch, ln: BatchLine, code: int, response: Any, request_id: str):
        async def record(row: UsageRow) -> bool:
            body = response() if callable(response) else response
            return await self._answer(batch, ln, "done" if code == 200 else "error", code, body, None,
                                      request_id, row)
        return record
