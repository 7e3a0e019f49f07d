"""`RequestRun`: one admitted HTTP request's life (limiter admission, engine requests,
settlement and usage).

    async with admitted(state, principal) as ticket:   # 429 here, before the body is read
        ...                                          # parse, tokenize
        run = RequestRun(ticket, entry, tier, job.inputs)
        await run.admit()                       # tokens reserved (429 here); nothing queued yet
    await run.submit(sheddable=not stream)      # 400/429/503 here; the engine has the request(s)
    async for i, out in run.events(): ...       # 429/503 here if the engine shed it
    usage = await run.finish("ok")              # usage row committed, reservation settled

A run ends exactly once, in one of two ways. `finish` (success, error, disconnect, a cut):
exactly one usage row is written and the lease is settled to exactly what the row says.
`refuse`, when the engine is overloaded (it refused a prompt at submit, or shed a queued one
of a non-streaming request before any answer went out): the admission is cancelled
(`Limiter.cancel`: no rate, lease or budget keeps it). A refusal at submit writes no usage row,
as for a limiter's 429 (the request never started); a shed one, which had been queued, ends
early and writes one `cancelled` row of 0 tokens. Whichever comes first wins; the other is then
a no-op.

A run that ends early (`cancelled`: client gone, cut; `error`: engine failure) bills the
prompts whose prefill ran and the completion sent to the client (`mark_sent`). `cut(reason)`
(the shutdown drain, the run's `request_timeout_s` timer) makes its reader raise `RunCut`;
admitted runs are in `state.lifecycle.runs` until they end, so a shutdown cuts exactly those.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from lockgate.engine import (
    EngineDead,
    EngineOverloaded,
    InvalidRequest,
    PromptTooLong,
    RequestOutput,
    RequestStream,
    UnknownModel,
)
from lockgate.gateway.errors import APIError
from lockgate.gateway.model_directory import ModelEntry, not_found
from lockgate.gateway.responses import Usage
from lockgate.gateway.serving.job import RunInputs
from lockgate.gateway.serving.ticket import Ticket
from lockgate.gateway.serving.tiers import (
    TIERS,
    RunCut,
    cut_error,
    engine_unavailable,
    flex_refusal,
    overloaded,
    submit_error,
)
from lockgate.tenancy.limiter import Decision, Lease
from lockgate.tenancy.quota import budget_tokens
from lockgate.tenancy.usage.writer import UsageRow

logger = logging.getLogger(__name__)


class RequestRun:
    def __init__(
        self,
        ticket: Ticket,
        entry: ModelEntry,
        tier: str,
        inputs: RunInputs,
    ) -> None:
        principal = ticket.principal
        if principal.tenant_id is None or principal.tenant_name is None:
            raise ValueError(f"key {principal.key_id} belongs to no tenant: a request runs for a tenant")
        self.ticket = ticket
        self.state = ticket.state
        self.principal = principal
        self.tenant_id: str = principal.tenant_id
        self.tenant_name: str = principal.tenant_name
        self.entry = entry
        self.tier = tier
        ticket.tier = tier          # a refusal of its tokens is counted in this tier
        self.service_class, tier_priority = TIERS[tier]
        # vLLM's `priority` (smaller sooner): the engine orders by class, then tenant
        # fairness, and only then by it, so it orders this tenant's own requests alone
        self.priority = tier_priority + inputs.priority
        self.prompts = inputs.prompts
        # a plan without speculation: its requests decode without drafts, whatever they ask
        self.params = inputs.params if principal.speculative else [replace(p, speculative=False) for p in inputs.params]
        self.reserve_tokens = inputs.reserve_tokens
        # the engine puts the tenant into every prefix-block hash: no sharing across tenants
        self.cache_salt = inputs.cache_salt
        self.cache_hint = inputs.cache_hint
        self.id = ticket.id
        self.t0 = ticket.t0
        self.decision: Decision | None = None
        self.lease: Lease | None = None
        self.streams: list[RequestStream] = []
        self.finals: dict[int, RequestOutput] = {}
        # (prompt, choice) -> the completion tokens the client has received: a token whose
        # text is held back (half a character, a possible stop string) went nowhere yet
        self.sent: dict[tuple[int, int], int] = {}
        self.client_request_id: str | None = None     # the client's x-request-id, on its row
        self._cut: RunCut | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._last_out: dict[int, float] = {}         # per prompt, when its last output came
        self._pumps: list[asyncio.Task] = []
        self._open = 0
        self.sheddable = False
        self.continuous_usage = False     # a stream's every chunk carries the usage so far
        self._ended: asyncio.Future | None = None     # set by the first of finish / refuse
        self.usage: Usage | None = None

    # -- admission ----------------------------------------------------------------------------
    async def admit(self) -> None:
        """Reserve the run's tokens (the ticket's step 2: 429 or 503 here, the admission then
        released) and take the admission over from the ticket."""
        self.decision = await self.ticket.reserve(self.reserve_tokens)
        self.lease = self.ticket.take()
        self.state.lifecycle.runs.add(self)
        left = self.state.settings.request_timeout_s - (time.time() - self.t0)
        self._timer = asyncio.get_running_loop().call_later(max(0.0, left), self.cut, "timeout")

    def cut(self, reason: str) -> None:
        """End the run from outside ("shutdown" or "timeout"): its reader raises `RunCut`."""
        if self._ended is not None or self._cut is not None:
            return
        self._cut = cut_error(reason, self.state.settings.request_timeout_s)
        logger.warning("request %s cut (%s)", self.id, reason)
        self._queue.put_nowait(("cut", -1, None))

    def mark_sent(self, i: int, choice: int, tokens: int) -> None:
        """Prompt `i`'s choice `choice` went out to the client up to its first `tokens`
        completion tokens (called once the chunk carrying them was handed on)."""
        self.sent[(i, choice)] = tokens

    def _left(self) -> None:
        """The run has ended: out of the lifecycle's runs, its timer stopped, its waiters told."""
        self.state.lifecycle.runs.discard(self)
        if self._timer is not None:
            self._timer.cancel()
        if self._ended is not None:
            self._ended.set_result(None)

    async def submit(self, *, sheddable: bool) -> None:
        """Hand every prompt to the engine. `sheddable` (a non-streaming request: nothing is
        answered until it ends) lets the engine shed its queued prompts before they start.
        On a refusal nothing stays queued and the run is over: refused (`refuse`) when the
        engine is overloaded, finished with an error row otherwise."""
        self.state.models.push_weight(self.tenant_id, self.principal.weight)
        self.sheddable = sheddable
        try:
            self._flex_bound()
            self._queue_prompts()
            await self._accepted()
        except EngineOverloaded as exc:
            raise await self.refuse(exc) from None
        except APIError:
            await self._refused_at_submit()
            raise
        self._open = len(self.streams)
        # one task a prompt reads its stream into the run's queue, which `cut` can also reach
        for i, stream in enumerate(self.streams):
            self._pumps.append(asyncio.get_running_loop().create_task(self._pump(i, stream)))

    async def _refused_at_submit(self) -> None:
        """The engine refused a prompt at submit (not for overload): the run ends with an
        error row."""
        await self.finish("error")

    def _flex_bound(self) -> None:
        """The gateway's own bound on background work (serving/tiers.py `flex_refusal`)."""
        if self.tier == "flex":
            exc = flex_refusal(self.tier, self.entry.engine.stats().overload,
                               self.state.settings.flex_max_queue_s)
            if exc is not None:
                raise exc

    def _queue_prompts(self) -> None:
        engine = self.entry.engine
        try:
            for i, (ids, sp) in enumerate(zip(self.prompts, self.params, strict=True)):
                self.streams.append(engine.submit(
                    ids, sp, f"{self.id}-{i}", tenant=self.tenant_id, service_class=self.service_class,
                    priority=self.priority, cache_salt=self.cache_salt, sheddable=self.sheddable,
                    cache_hint=self.cache_hint,
                ))
        except UnknownModel as exc:
            if self.entry.parent is not None:       # an adapter deleted since the request resolved it
                raise not_found(self.entry.name) from None
            raise submit_error(exc) from None
        except (PromptTooLong, EngineDead, InvalidRequest) as exc:
            raise submit_error(exc) from None

    async def _accepted(self) -> None:
        """Every prompt held by the engine (a pool's worker answers here, not at submit)."""
        try:
            for stream in self.streams:
                await stream.accepted()
        except (PromptTooLong, EngineDead, InvalidRequest) as exc:
            raise submit_error(exc) from None

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait(("out", i, out))
            self._queue.put_nowait(("done", i, None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            self._queue.put_nowait(("err", i, exc))
        finally:
            stream.close()

    async def events(self):
        """(prompt index, cumulative output) as they arrive, until every prompt finished; a
        cut raises its `RunCut` instead."""
        while self._open > 0:
            kind, i, item = await self._queue.get()
            if kind == "cut" and self._cut is not None:
                raise self._cut
            if kind == "out":
                self.finals[i] = item
                self._tick(i)
                yield i, item
            elif kind == "done":
                self._open -= 1
            elif kind == "err":
                if isinstance(item, EngineDead):
                    raise engine_unavailable(item, "stopped")
                if isinstance(item, EngineOverloaded):
                    raise await self._shed(item)
                raise item

    def _tick(self, i: int) -> None:
        """vLLM's inter-token latency: the time between prompt `i`'s successive outputs."""
        now = time.monotonic()
        last = self._last_out.get(i)
        if last is not None:
            m = self.state.metrics
            m.child(m.vllm_itl, self.entry.name).observe(now - last)
        self._last_out[i] = now

    async def _shed(self, exc: EngineOverloaded) -> BaseException:
        """A stream raised EngineOverloaded: the engine shed that prompt from its queue. A
        sheddable run has answered nothing yet, so the whole run is refused (its other
        prompts closed) as if at submit. A stream that is not sheddable must never see this
        (its 200 went out): an engine fault, raised as it is."""
        if self.sheddable:
            return await self.refuse(exc)
        return exc

    def _close_streams(self) -> None:
        for t in self._pumps:
            t.cancel()
        for s in self.streams:
            s.close()

    # -- the end ------------------------------------------------------------------------------
    async def refuse(self, exc: EngineOverloaded) -> APIError:
        """End the run because the engine is overloaded (instead of `finish`; a no-op after
        it): streams closed, the admission cancelled so no rate, lease or budget counts it,
        no usage row. Returns the 429 (flex) or 503 to answer with."""
        if self._ended is None:
            self._ended = asyncio.get_running_loop().create_future()
            try:
                self._close_streams()
                m = self.state.metrics
                m.child(m.overload_refusals, self.tenant_name, self.tier,
                        "shed" if exc.shed else "refused").inc()
                if self.lease is not None:
                    lease, self.lease = self.lease, None
                    self.state.inflight.pop(self.id, None)
                    try:
                        await asyncio.shield(self.state.limiter.cancel(lease))
                    except Exception:  # any failure: the lease expires; the window keeps it
                        logger.warning("could not cancel the admission of %s", self.id,
                                       exc_info=True)
                if exc.shed:
                    await self._shed_row()
            finally:
                self._left()
        return overloaded(self.tier, exc)

    async def _shed_row(self) -> None:
        """A run shed from the engine's queue ended early: one `cancelled` row of 0 tokens
        (nothing ran, nothing was sent), as the usage rule says; its refusal is answered
        whether or not the row could be written."""
        try:
            self.usage = self.usage_dict("cancelled")
            await asyncio.shield(self.state.usage.submit(self._usage_row("cancelled", time.time())))
        except Exception as exc:  # noqa: BLE001 - logged; the spool keeps rows while the database is down
            logger.error("usage row for shed request %s not committed: %r", self.id, exc)

    def counts(self, status: str = "ok") -> tuple[int, int, int]:
        """(prompt, cached, completion) tokens by the usage rule: all of them for `ok`; for
        a run that ended early, the prompts whose prefill ran and the completion sent."""
        cached = sum(o.num_cached_tokens for o in self.finals.values())
        if status == "ok":
            prompt = sum(len(ids) for ids in self.prompts)
            completion = sum(len(c.token_ids) for o in self.finals.values() for c in o.outputs)
        else:
            prompt = sum(len(self.prompts[i]) for i in self.finals)   # an output: prefill ran
            completion = sum(self.sent.values())
        return prompt, cached, completion

    def usage_dict(self, status: str = "ok") -> Usage:
        prompt, cached, completion = self.counts(status)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def finish(self, status: str, while_committing: Callable[[], None] | None = None) -> Usage:
        """Settle and record, once; later calls (and calls after `refuse`) wait for the first
        end and return its usage (a `cancelled` run's after a refusal). Raises APIError(503) when the usage
        row could not be committed (the caller must not then show the client a completion).
        `while_committing()` (first call only) runs while the usage row is being written,
        with `self.usage` already set: the caller's own work on the response, off the path
        the response waits on."""
        if self._ended is not None:
            await asyncio.shield(self._ended)
            return self.usage or self.usage_dict("cancelled")
        self._ended = asyncio.get_running_loop().create_future()
        error: BaseException | None = None
        used, budget = 0, 0
        try:
            self._close_streams()
            now = time.time()
            used, budget = self._billed_tokens(status)
            self.usage = self.usage_dict(status)
            row = self._usage_row(status, now)
            # The usage commit and the lease settlement go out together (one wait, not two),
            # and the CPU work below (metrics, the caller's `while_committing`) is done while
            # they are in flight rather than after.
            settle = None
            if self.lease is not None:
                self.state.inflight.pop(self.id, None)
                settle = asyncio.ensure_future(self.state.limiter.settle(self.lease, used, budget))
                self.lease = None
            committed = None
            try:
                committed = self.state.usage.submit(row)
            except Exception as exc:  # noqa: BLE001 - whatever the writer raises: 503, below
                logger.error("usage row for request %s not committed: %r", self.id, exc)
                error = exc
            await asyncio.sleep(0)      # the writer and the settlement send their commands
            self._count(status, now)
            if while_committing is not None and error is None:
                while_committing()
            if committed is not None:
                try:
                    await committed
                except Exception as exc:  # noqa: BLE001 - whatever the commit raises: 503, below
                    logger.error("usage row for request %s not committed: %r", self.id, exc)
                    error = exc
            if settle is not None:
                try:
                    await asyncio.shield(settle)     # a disconnect's cancel must not cancel it
                except Exception:  # any failure: leases expire on their own
                    logger.warning("could not settle the lease of %s", self.id, exc_info=True)
        finally:
            if self.lease is not None:
                self.state.inflight.pop(self.id, None)
                try:
                    await self.state.limiter.settle(self.lease, used, budget)
                except Exception:  # any failure: leases expire on their own
                    logger.warning("could not settle the lease of %s", self.id, exc_info=True)
            self._left()
        if error is not None:
            raise APIError(503, "The request's usage could not be recorded; it was not completed.",
                           code="usage_not_recorded", headers={"retry-after": "1"})
        return self.usage

    async def _release_lease(self, used: tuple[int, int] | None) -> None:
        """Settle the lease to `used` (`_billed_tokens`: the window's tokens, the budgets'), or
        cancel it (None); failures logged (leases expire on their own)."""
        if self.lease is None:
            return
        lease, self.lease = self.lease, None
        self.state.inflight.pop(self.id, None)
        try:
            if used is None:
                await asyncio.shield(self.state.limiter.cancel(lease))
            else:
                await asyncio.shield(self.state.limiter.settle(lease, *used))
        except Exception:  # any failure: the lease expires; the reconciler settles the rest
            logger.warning("could not end the admission of %s", self.id, exc_info=True)

    def _billed_tokens(self, status: str) -> tuple[int, int]:
        """What the lease settles to, exactly the row's: prompt + completion tokens (the
        tokens-per-minute window), and those with cached prompt tokens at the plan's price
        (the budgets)."""
        prompt, cached, completion = self.counts(status)
        return prompt + completion, budget_tokens(prompt, cached, completion,
                                                  self.principal.cached_input_price)

    def _times(self) -> tuple[list[float], list[float], list[float]]:
        """The prompts' first-scheduled, first-token and finished times, where known."""
        metrics = [o.metrics for o in self.finals.values() if o.metrics is not None]
        return ([m.first_scheduled_time for m in metrics if m.first_scheduled_time],
                [m.first_token_time for m in metrics if m.first_token_time],
                [m.finished_time for m in metrics if m.finished_time])

    def _usage_row(self, status: str, now: float) -> UsageRow:
        prompt, cached, completion = self.counts(status)
        scheduled, first_tok, _ = self._times()
        return UsageRow(
            request_id=self.id, tenant_id=self.tenant_id,
            api_key_id=self.principal.key_id, model=self.entry.name, service_tier=self.tier,
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
            budget_tokens=budget_tokens(prompt, cached, completion, self.principal.cached_input_price),
            status=status,
            queue_ms=(min(scheduled) - self.t0) * 1000 if scheduled else (now - self.t0) * 1000,
            ttft_ms=(min(first_tok) - self.t0) * 1000 if first_tok else None,
            total_ms=(now - self.t0) * 1000,
            created_at=datetime.now(UTC), client_request_id=self.client_request_id,
        )

    def _count(self, status: str, now: float) -> None:
        """The run in the Prometheus metrics: requests, tokens, latencies."""
        prompt, cached, completion = self.counts(status)
        _, first_tok, ends = self._times()
        m = self.state.metrics
        tenant = self.tenant_name
        m.child(m.requests, tenant, self.entry.name, self.tier, status).inc()
        m.child(m.tokens, tenant, "prompt").inc(prompt)
        m.child(m.tokens, tenant, "cached").inc(cached)
        m.child(m.tokens, tenant, "completion").inc(completion)
        m.child(m.e2e, self.tier).observe(now - self.t0)
        model = self.entry.name
        m.child(m.vllm_e2e, model).observe(now - self.t0)
        m.child(m.vllm_prompt_tokens, model).inc(prompt)
        m.child(m.vllm_generation_tokens, model).inc(completion)
        if status == "ok":      # one a prompt, as vLLM counts a completions request's prompts
            for o in self.finals.values():
                reason = o.outputs[0].finish_reason if o.outputs else None
                m.child(m.vllm_success, model, reason or "stop").inc()
        for o in self.finals.values():
            if o.metrics is not None and o.metrics.first_scheduled_time:
                m.child(m.vllm_queue, model).observe(o.metrics.first_scheduled_time - o.metrics.arrival_time)
        if first_tok:
            m.child(m.ttft, self.tier).observe(min(first_tok) - self.t0)
            m.child(m.vllm_ttft, model).observe(min(first_tok) - self.t0)
            if completion > len(self.finals) and ends:
                m.child(m.tpot, self.tier).observe(
                    (max(ends) - min(first_tok)) / (completion - len(self.finals)))
