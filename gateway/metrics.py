"""Prometheus metrics, one registry per app (so tests can run several apps in one process).

Two vocabularies side by side. Lockgate's own (`lockgate_*`): per tenant, tier and class.
vLLM's (`vllm:*`, its names, types and `model_name` label), so dashboards and autoscalers
built for vLLM read Lockgate unchanged: per model from each engine's stats, and per pool
worker (label `worker`) where the engines run in a pool (`lockgate serve --pool`).

    vllm:num_requests_running, vllm:num_requests_waiting     gauges (running: sequences)
    vllm:kv_cache_usage_perc                                  gauge, 0 to 1
    vllm:prefix_cache_queries, vllm:prefix_cache_hits        counters, in tokens, label `tier`
                                                              (device, host: the host KV tier)
    lockgate_kv_tier_blocks, lockgate_kv_tier_capacity_blocks, lockgate_kv_tier_evictions
                    per model and KV tier; lockgate_kv_offload_stores, lockgate_kv_offload_copy_ins
                    the blocks copied to the host tier and back
    vllm:num_preemptions                                      counter
    vllm:lora_requests_info                                   gauge (labels as vLLM's)
    vllm:spec_decode_num_drafts, vllm:spec_decode_num_draft_tokens,
    vllm:spec_decode_num_accepted_tokens                      counters (speculative decoding),
                                                              per `service_class`
    vllm:spec_decode_num_accepted_tokens_per_pos              counter, labels `service_class`, `position`
    lockgate_spec_decode_enabled                              gauge, 1 while a class drafts
    lockgate_engine_threads{width=now|full}, lockgate_engine_neighbour_cores   adaptive threads
    lockgate_tp_*   a model split over ranks: seconds in collectives (and the latest step's),
                    the forward's seconds, each rank's memory, rank failures
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
    vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds   histograms
    vllm:prompt_tokens_total, vllm:generation_tokens_total    counters, each request's usage
    vllm:request_success_total                                counter, also by finished_reason

Every HTTP answer is counted by `CountResponses` (`lockgate_http_requests{method, route,
status}`), and every error answer also by status and code (`lockgate_http_errors`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lockgate.engine import EngineStats
from lockgate.gateway.root_path import route_path

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# vLLM's bucket edges (seconds), so its dashboards' quantiles mean the same here
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

Snapshot = Callable[[], dict]


class _EngineCollector(Collector):
    """Reads the engines' latest stats at scrape time: Lockgate's per-class series, and
    vLLM's per-model ones (and, for pool engines, vLLM's per-worker ones)."""

    def __init__(self, stats: Callable[[], Iterable[tuple[str, EngineStats]]],
                 pools: list[Snapshot]) -> None:
        self._stats = stats
        self._pools = pools

    def collect(self):
        stats = list(self._stats())
        yield from self._lockgate(stats)
        yield from self._parallel(stats)
        yield from self._vllm(stats)
        yield from self._spec(stats)
        yield from self._kv_tiers(stats)

    @staticmethod
    def _kv_tiers(stats: list[tuple[str, EngineStats]]):
        """Per model and KV tier: blocks held and their room, evictions; the offload copies."""
        held = GaugeMetricFamily("lockgate_kv_tier_blocks", "KV blocks a tier holds (device: in use)",
                                 labels=["model_name", "tier"])
        room = GaugeMetricFamily("lockgate_kv_tier_capacity_blocks", "KV blocks a tier has room for",
                                 labels=["model_name", "tier"])
        evicted = CounterMetricFamily("lockgate_kv_tier_evictions", "Cached KV blocks a tier evicted",
                                      labels=["model_name", "tier"])
        stores = CounterMetricFamily("lockgate_kv_offload_stores", "KV blocks copied device -> host tier",
                                     labels=["model_name"])
        loads = CounterMetricFamily("lockgate_kv_offload_copy_ins", "KV blocks copied host tier -> device",
                                    labels=["model_name"])
        for model, s in stats:
            k = s.kv
            for tier, n, cap, ev in (("device", k.used, k.total, k.device_evictions),
                                     ("host", k.host_held, k.host_total, k.host_evictions)):
                held.add_metric([model, tier], n)
                room.add_metric([model, tier], cap)
                evicted.add_metric([model, tier], ev)
            stores.add_metric([model], k.host_stores)
            loads.add_metric([model], k.host_copy_ins)
        return held, room, evicted, stores, loads

    @staticmethod
    def _spec(stats: list[tuple[str, EngineStats]]):
        """vLLM's speculative-decoding counters, for the models that speculate, per service
        class (each class drafts, and is switched off, on its own: engine/spec/switch.py)."""
        drafts = CounterMetricFamily("vllm:spec_decode_num_drafts", "Decodes that carried draft tokens")
        draft_tokens = CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed")
        accepted = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their position in the draft")
        enabled = GaugeMetricFamily("lockgate_spec_decode_enabled", "1 while a class drafts (the switch's latest say)",
                                    labels=["model", "service_class"])
        for model, s in stats:
            for cls, row in (s.spec.classes if s.spec is not None else {}).items():
                labels = {"model_name": model, "service_class": cls}
                drafts.add_sample(drafts.name + "_total", labels, row.num_drafts)
                draft_tokens.add_sample(draft_tokens.name + "_total", labels, row.num_draft_tokens)
                accepted.add_sample(accepted.name + "_total", labels, row.num_accepted_tokens)
                for pos, n in enumerate(row.accepted_per_pos):
                    per_pos.add_sample(per_pos.name + "_total", {**labels, "position": str(pos)}, n)
                enabled.add_metric([model, cls], float(row.enabled))
        return drafts, draft_tokens, accepted, per_pos, enabled

    @staticmethod
    def _lockgate(stats: list[tuple[str, EngineStats]]):
        waiting = GaugeMetricFamily("lockgate_queue_depth", "Requests waiting, by model and class",
                                    labels=["model", "service_class"])
        running = GaugeMetricFamily("lockgate_running", "Sequences running, by model and class",
                                    labels=["model", "service_class"])
        kv = GaugeMetricFamily("lockgate_kv_blocks", "KV cache blocks, by model and state",
                               labels=["model", "state"])
        kv_usage = GaugeMetricFamily("lockgate_kv_usage_ratio", "Fraction of KV blocks in use",
                                     labels=["model"])
        pre = CounterMetricFamily("lockgate_preemptions", "Sequences preempted", labels=["model"])
        threads = GaugeMetricFamily("lockgate_engine_threads", "Intra-op threads: now, and the full width",
                                    labels=["model", "width"])
        others = GaugeMetricFamily("lockgate_engine_neighbour_cores",
                                   "Cores other processes took from the engine's, over the latest window",
                                   labels=["model"])
        for model, s in stats:
            if s.threads is not None:
                threads.add_metric([model, "now"], s.threads.threads)
                threads.add_metric([model, "full"], s.threads.max_threads)
                others.add_metric([model], s.threads.others_cores)
            for cls, n in s.waiting_requests.items():
                waiting.add_metric([model, cls], n)
            for cls, n in s.running.items():
                running.add_metric([model, cls], n)
            kv.add_metric([model, "used"], s.kv.used)
            kv.add_metric([model, "free"], s.kv.free)
            kv_usage.add_metric([model], s.kv.used / s.kv.total if s.kv.total else 0.0)
            pre.add_metric([model], s.num_preemptions)
        return waiting, running, kv, kv_usage, pre, threads, others

    @staticmethod
    def _parallel(stats: list[tuple[str, EngineStats]]):
        """Tensor parallelism's communication: collective seconds against forward seconds
        give the share of each step spent communicating."""
        size = GaugeMetricFamily("lockgate_tp_size", "Ranks a model is split over", labels=["model"])
        comm = CounterMetricFamily("lockgate_tp_collective_seconds",
                                   "Seconds rank 0 spent in collectives", labels=["model"])
        forward = CounterMetricFamily("lockgate_tp_forward_seconds",
                                      "Seconds of the steps' forwards (collectives included)", labels=["model"])
        last = GaugeMetricFamily("lockgate_tp_step_collective_seconds",
                                 "Seconds in collectives in the latest step", labels=["model"])
        failures = CounterMetricFamily("lockgate_tp_rank_failures", "Rank failures (each rebuilt the group)",
                                       labels=["model"])
        memory = GaugeMetricFamily("lockgate_tp_rank_memory_bytes", "Bytes each rank holds, by part",
                                   labels=["model", "rank", "part"])
        for model, s in stats:
            p = s.parallel
            if p is None:
                continue
            size.add_metric([model], p.tensor_parallel_size)
            comm.add_metric([model], p.collective_s)
            forward.add_metric([model], p.forward_s)
            last.add_metric([model], p.last_step_collective_s)
            failures.add_metric([model], p.rank_failures)
            for r in p.ranks:
                memory.add_metric([model, str(r.rank), "weights"], r.weights_bytes)
                memory.add_metric([model, str(r.rank), "kv_cache"], r.kv_cache_bytes)
        return size, comm, forward, last, failures, memory

    def _vllm(self, stats: list[tuple[str, EngineStats]]):
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Sequences running (a request of n samples counts n)")
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to start")
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1)")
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache")
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        pre = CounterMetricFamily("vllm:num_preemptions", "Sequences preempted")
        lora = GaugeMetricFamily("vllm:lora_requests_info",
                                 "Adapters in use (value: the time of the scrape), as vLLM's")
        for model, s in stats:
            labels = {"model_name": model}
            running.add_sample(running.name, labels, sum(s.running.values()))
            waiting.add_sample(waiting.name, labels, sum(s.waiting_requests.values()))
            kv.add_sample(kv.name, labels, s.kv.used / s.kv.total if s.kv.total else 0.0)
            # per KV tier: a hit copied in from the host tier counts there, not on the device
            k = s.kv
            for tier, q, h in (("device", k.prefix_cache_queries, k.device_hits),
                               ("host", k.host_queries, k.host_hits)):
                queries.add_sample(queries.name + "_total", {**labels, "tier": tier}, q)
                hits.add_sample(hits.name + "_total", {**labels, "tier": tier}, h)
            pre.add_sample(pre.name + "_total", labels, s.num_preemptions)
            if s.lora is not None:
                busy = [n for n, k in s.lora.requests.items() if k > 0]
                run = sorted(n for n in busy if n in s.lora.in_slots)
                wait = sorted(n for n in busy if n not in s.lora.in_slots)
                lora.add_sample(lora.name, {**labels, "max_lora": str(s.lora.max_loras),
                                            "running_lora_adapters": ",".join(run),
                                            "waiting_lora_adapters": ",".join(wait)}, time.time())
        for snapshot in self._pools:
            for name, w in snapshot().get("workers", {}).items():
                for cls, n in w["waiting"].items():
                    waiting.add_sample(waiting.name, {"worker": name, "service_class": cls}, n)
                for cls, n in w["running"].items():
                    running.add_sample(running.name, {"worker": name, "service_class": cls}, n)
                kv.add_sample(kv.name, {"worker": name},
                              w["kv_used"] / w["kv_total"] if w["kv_total"] else 0.0)
                host = w.get("kv_host", {})
                for tier, q, h in (("device", w.get("prefix_cache_queries", 0),
                                    max(0, w.get("prefix_cache_hits", 0) - host.get("hits", 0))),
                                   ("host", host.get("queries", 0), host.get("hits", 0))):
                    queries.add_sample(queries.name + "_total", {"worker": name, "tier": tier}, q)
                    hits.add_sample(hits.name + "_total", {"worker": name, "tier": tier}, h)
        return running, waiting, kv, queries, hits, pre, lora


class _PoolCollector(Collector):
    """Each pool worker's last report, with a `worker` label: adapters, restarts seen, and
    whether this replica considers it down (its vLLM series: `_EngineCollector`)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def collect(self):
        loras = GaugeMetricFamily("lockgate_pool_worker_loras", "Adapters a pool worker serves",
                                  labels=["worker"])
        up = GaugeMetricFamily("lockgate_pool_worker_up", "1 while this replica reaches the worker",
                               labels=["worker"])
        restarts = CounterMetricFamily("lockgate_pool_worker_restarts", "Worker restarts this replica saw",
                                       labels=["worker"])
        devices = GaugeMetricFamily("lockgate_pool_worker_devices",
                                    "Devices a pool worker holds (a tensor-parallel group: its size)",
                                    labels=["worker"])
        index = GaugeMetricFamily("lockgate_pool_kv_index_blocks",
                                  "Blocks the router's KV index says a worker holds", labels=["worker", "tier"])
        stale = GaugeMetricFamily("lockgate_pool_kv_index_staleness_seconds",
                                  "Seconds since a worker's KV events were applied (-1: not trusted)",
                                  labels=["worker"])
        for name, w in self._snapshot().get("workers", {}).items():
            ix = w.get("kv_index", {})
            for tier, n in ix.get("blocks", {}).items():
                index.add_metric([name, tier], n)
            age = ix.get("staleness_s")
            stale.add_metric([name], -1.0 if age is None or not ix.get("fresh") else age)
            devices.add_metric([name], w.get("devices", 0))
            loras.add_metric([name], len(w["loras"]))
            up.add_metric([name], 0.0 if w["down"] else 1.0)
            restarts.add_metric([name], w["restarts"])
        yield from (loras, up, restarts, devices, index, stale)


class _LimiterCollector(Collector):
    """The limiter's own counts while Redis fails (`FailoverLimiter.counts`), at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self):
        events = CounterMetricFamily(
            "lockgate_limiter_redis_events",
            "While Redis failed: outages, decisions by this replica's in-process limiter, "
            "settlements queued for Redis and dropped from a full queue", labels=["event"])
        for event, n in self._counts().items():
            events.add_metric([event], n)
        yield events


class Metrics:
    def __init__(self, engine_stats: Callable[[], Iterable[tuple[str, EngineStats]]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("lockgate_requests", "Requests by tenant, model, tier and status",
                                ["tenant", "model", "service_tier", "status"], registry=r)
        self.tokens = Counter("lockgate_tokens", "Tokens by tenant and kind (prompt, cached, completion)",
                              ["tenant", "kind"], registry=r)
        self.ttft = Histogram("lockgate_time_to_first_token_seconds", "Time to first token by tier",
                              ["service_tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("lockgate_time_per_output_token_seconds",
                              "Time per output token after the first, by tier", ["service_tier"],
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("lockgate_e2e_request_latency_seconds", "End-to-end latency by tier",
                             ["service_tier"], buckets=_LATENCY_BUCKETS, registry=r)
        self.rejections = Counter("lockgate_limiter_rejections", "Requests refused by a limit",
                                  ["tenant", "limit"], registry=r)
        self.overload_refusals = Counter(
            "lockgate_overload_refusals",
            "Requests the overloaded engine refused at submit (reason=refused) or shed from its "
            "queue before they started (reason=shed); answered 429 (flex) or 503, never billed",
            ["tenant", "service_tier", "reason"], registry=r)
        self.http_requests = Counter("lockgate_http_requests", "HTTP answers by method, route and status",
                                     ["method", "route", "status"], registry=r)
        self.http_errors = Counter("lockgate_http_errors", "Error answers (4xx, 5xx) by status and code",
                                   ["status", "code"], registry=r)
        # vLLM's request histograms, by model
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                   ["model_name"], buckets=VLLM_TTFT_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds",
                                  "Time between a request's successive outputs",
                                  ["model_name"], buckets=VLLM_ITL_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency",
                                  ["model_name"], buckets=VLLM_REQUEST_BUCKETS, registry=r)
        self.vllm_queue = Histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival at the engine to first being scheduled",
                                    ["model_name"], buckets=VLLM_REQUEST_BUCKETS, registry=r)
        # vLLM's request counters, by model: tokens as each request's usage counts them, and
        # the requests that finished (status ok) by the finish_reason of their first choice
        self.vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of the requests served",
                                          ["model_name"], registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated for the requests served",
                                              ["model_name"], registry=r)
        self.vllm_success = Counter("vllm:request_success", "Requests finished, by finish reason",
                                    ["model_name", "finished_reason"], registry=r)
        self._pools: list[Snapshot] = []
        r.register(_EngineCollector(engine_stats, self._pools))
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def watch_pool(self, snapshot: Snapshot) -> None:
        """Export each pool worker's series with a `worker` label (`Pool.snapshot`)."""
        self._pools.append(snapshot)
        self.registry.register(_PoolCollector(snapshot))

    def watch_limiter(self, counts: Callable[[], dict[str, int]]) -> None:
        """Export the limiter's failure counts (event -> count) as `lockgate_limiter_redis_events`."""
        self.registry.register(_LimiterCollector(counts))

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once per label set (prometheus-client's own
        `labels` validates and locks on every call: a few µs, seven times a request)."""
        key = (id(metric), labels)     # the metrics above live as long as this object
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c

    def count_response(self, method: str, route: str, status: int, code: str | None) -> None:
        self.child(self.http_requests, method, route, str(status)).inc()
        if status >= 400:
            self.child(self.http_errors, str(status), code or "").inc()


class CountResponses:
    """ASGI middleware, outermost: every answer in `lockgate_http_requests` (the route's
    template, not the raw path, so ids do not make series), every 4xx and 5xx also in
    `lockgate_http_errors` with the `code` of its OpenAI-shaped body. A route that raises
    past every handler is counted as the 500 the server answers."""

    MAX_ERROR_BODY = 4096

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = b""

        async def counting_send(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < self.MAX_ERROR_BODY:
                body += message.get("body", b"")[: self.MAX_ERROR_BODY]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not status:
                self._count(scope, 500, b'{"error": {"code": "internal_error"}}')
            raise
        if status:
            self._count(scope, status, body)

    @staticmethod
    def _count(scope: Scope, status: int, body: bytes) -> None:
        state = getattr(scope["app"].state, "lockgate", None) if "app" in scope else None
        if state is None:
            return          # before start-up finished: no registry yet
        state.metrics.count_response(scope["method"], _route_template(scope), status,
                                     _error_code(body) if status >= 400 else None)


def _route_template(scope: Scope) -> str:
    """The matched route's path template, its router's prefix included (`/admin/v1/tenants/
    {tenant_id}`: the route knows only `/tenants/{tenant_id}`); "unmatched" for none."""
    route = scope.get("route")
    template, regex = getattr(route, "path", None), getattr(route, "path_regex", None)
    if not template or regex is None:
        return "unmatched"
    path = route_path(scope)
    cut = 0
    while not regex.match(path[cut:]):
        cut = path.find("/", cut + 1)
        if cut < 0:
            return template
    return path[:cut] + template


def _error_code(body: bytes) -> str | None:
    """The `error.code` of an OpenAI-shaped error body, if it is one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
