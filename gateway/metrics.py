"""Prometheus metrics, one registry per app (so tests can run several apps in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class _EngineCollector(Collector):
    """Reads the engines' latest stats at scrape time: queues, running, KV, preemptions."""

    def __init__(self, stats: Callable[[], Iterable[tuple[str, EngineStats]]]) -> None:
        self._stats = stats

    def collect(self):
        waiting = GaugeMetricFamily("lockgate_queue_depth", "Requests waiting, by model and class",
                                    labels=["model", "service_class"])
        running = GaugeMetricFamily("lockgate_running", "Sequences running, by model and class",
                                    labels=["model", "service_class"])
        kv = GaugeMetricFamily("lockgate_kv_blocks", "KV cache blocks, by model and state",
                               labels=["model", "state"])
        kv_usage = GaugeMetricFamily("lockgate_kv_usage_ratio", "Fraction of KV blocks in use",
                                     labels=["model"])
        pre = CounterMetricFamily("lockgate_preemptions", "Sequences preempted", labels=["model"])
        for model, s in self._stats():
            for cls, n in s.waiting_requests.items():
                waiting.add_metric([model, cls], n)
            for cls, n in s.running.items():
                running.add_metric([model, cls], n)
            used, total = s.kv.used, s.kv.total
            kv.add_metric([model, "used"], used)
            kv.add_metric([model, "free"], s.kv.free)
            kv_usage.add_metric([model], used / total if total else 0.0)
            pre.add_metric([model], s.num_preemptions)
        yield from (waiting, running, kv, kv_usage, pre)


class _PoolCollector(Collector):
    """Each pool worker's last report, with a `worker` label (vLLM's names for the engine
    series: a pool worker is one engine): waiting and running per class, KV use, adapters,
    restarts seen, and whether this replica considers it down."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self._snapshot = snapshot

    def collect(self):
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting, per pool worker and class",
                                    labels=["worker", "service_class"])
        running = GaugeMetricFamily("vllm:num_requests_running", "Sequences running, per pool worker and class",
                                    labels=["worker", "service_class"])
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use, per pool worker",
                               labels=["worker"])
        loras = GaugeMetricFamily("lockgate_pool_worker_loras", "Adapters a pool worker serves",
                                  labels=["worker"])
        up = GaugeMetricFamily("lockgate_pool_worker_up", "1 while this replica reaches the worker",
                               labels=["worker"])
        restarts = CounterMetricFamily("lockgate_pool_worker_restarts", "Worker restarts this replica saw",
                                       labels=["worker"])
        for name, w in self._snapshot().get("workers", {}).items():
            for cls, n in w["waiting"].items():
                waiting.add_metric([name, cls], n)
            for cls, n in w["running"].items():
                running.add_metric([name, cls], n)
            kv.add_metric([name], w["kv_used"] / w["kv_total"] if w["kv_total"] else 0.0)
            loras.add_metric([name], len(w["loras"]))
            up.add_metric([name], 0.0 if w["down"] else 1.0)
            restarts.add_metric([name], w["restarts"])
        yield from (waiting, running, kv, loras, up, restarts)


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
        self.http_errors = Counter("lockgate_http_errors", "Error responses by status and code",
                                   ["status", "code"], registry=r)
        r.register(_EngineCollector(engine_stats))
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def watch_pool(self, snapshot: Callable[[], dict]) -> None:
        """Export each pool worker's series with a `worker` label (`Pool.snapshot`)."""
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
