"""Prometheus metrics of ``dayzero serve`` (``GET /metrics``), on ``prometheus_client``.

Latencies and request outcomes are observed by the server as requests end; the engine's state
(queue, running requests, KV pages, prefix-cache hit rate, preemptions, token totals) is read from
the last snapshot of ``ServingEngine.metrics()`` that the step loop published, so a scrape never
touches the engine from another thread.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)

# Engine snapshot key -> (metric name, help, kind).
_ENGINE = {
    "waiting": ("dayzero_queue_depth", "Requests queued, not yet admitted to a slot", "gauge"),
    "running": ("dayzero_running_requests", "Requests holding a slot", "gauge"),
    "pages_used": ("dayzero_kv_pages_used", "KV pool pages in use", "gauge"),
    "pages_free": ("dayzero_kv_pages_free", "KV pool pages free", "gauge"),
    "prefix_cache_hit_rate": ("dayzero_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens", "gauge"),
    "preemptions": ("dayzero_preemptions", "Requests preempted (recomputed later)", "counter"),
    "prompt_tokens": ("dayzero_prompt_tokens", "Prompt tokens of admitted requests", "counter"),
    "generated_tokens": ("dayzero_generated_tokens", "Tokens generated", "counter"),
}


class _EngineCollector:
    """Exposes the latest engine snapshot as gauges and counters at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def collect(self):
        """Prometheus collector protocol."""
        values = self._snapshot()
        for key, (name, doc, kind) in _ENGINE.items():
            if key not in values:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc)
            family.add_metric([], float(values[key]))
            yield family


class ServerMetrics:
    """The server's registry: request outcomes and latency histograms, plus the engine's state."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        """``snapshot``: returns the latest ``ServingEngine.metrics()`` dict (thread-safe)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("dayzero_requests", "Finished requests by outcome "
                                "(stop, length, cancelled, error, rejected)", ["outcome"], registry=self.registry)
        self.ttft = Histogram("dayzero_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("dayzero_time_per_output_token_seconds", "Mean time between a request's tokens "
                              "after the first", buckets=_TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("dayzero_e2e_request_latency_seconds", "Time from arrival to the last token",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(snapshot))

    def finished(self, outcome: str, arrival: float, first: float | None, last: float, tokens: int) -> None:
        """Record one engine request that ended with ``outcome`` (timestamps from ``time.monotonic``)."""
        self.requests.labels(outcome).inc()
        if first is None:
            return
        self.ttft.observe(first - arrival)
        self.e2e.observe(last - arrival)
        if tokens > 1:
            self.tpot.observe((last - first) / (tokens - 1))

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)
