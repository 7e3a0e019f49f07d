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
