"""Prometheus metrics of one server, in its own ``CollectorRegistry`` (never the global one, so a
process can hold several apps, as the tests do).

Gauges and counters that the engine already keeps (blocks, queues, preemptions, tokens) are read
at scrape time from the engine loop's latest ``EngineStats`` snapshot by a custom collector;
per-request latencies are histograms observed by the HTTP handlers. Names follow vLLM's
(``vllm:num_requests_running`` -> ``kvroom_num_requests_running``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from kvroom.engine.engine import EngineStats

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
"""Upper bounds (seconds) of the latency histograms."""

FINISH_REASONS = ("stop", "length", "abort")


class EngineCollector(Collector):
    """Exposes an ``EngineStats`` snapshot, taken at scrape time, as gauges and counters."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = (
            ("kvroom_kv_cache_num_blocks", "KV blocks in the pool.", s.num_total_blocks),
            ("kvroom_kv_cache_num_used_blocks", "KV blocks held by requests.", s.num_used_blocks),
            ("kvroom_kv_cache_num_free_blocks", "KV blocks free.", s.num_free_blocks),
            ("kvroom_num_requests_running", "Requests admitted (holding blocks).", s.num_running),
            ("kvroom_num_requests_waiting", "Requests queued or preempted.", s.num_waiting),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        usage = s.num_used_blocks / s.num_total_blocks if s.num_total_blocks else 0.0
        yield GaugeMetricFamily(
            "kvroom_kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", value=usage
        )
        counters = (
            ("kvroom_num_preemptions", "Preemptions since start.", s.num_preemptions),
            ("kvroom_prompt_tokens", "Prompt tokens admitted.", s.num_prompt_tokens_total),
            ("kvroom_generation_tokens", "Tokens generated.", s.num_generation_tokens_total),
            ("kvroom_kv_cache_resizes", "Live resizes of the KV pool.", s.num_kv_resizes),
            (
                "kvroom_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (vLLM's prefix_cache_queries).",
                s.num_prefix_cache_queries,
            ),
            (
                "kvroom_prefix_cache_hits",
                "Prompt tokens whose KV came from the prefix cache (vLLM's prefix_cache_hits).",
                s.num_prefix_cache_hits,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """The registry of one app: the engine collector plus per-request histograms."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(stats))
        self.e2e_latency = Histogram(
            "kvroom_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "kvroom_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.requests = Counter(
            "kvroom_request_success",
            "Finished requests by finish reason (abort includes client disconnects).",
            ["finished_reason"],
            registry=self.registry,
        )
        for reason in FINISH_REASONS:
            self.requests.labels(finished_reason=reason)

    def observe_request(
        self, *, e2e_s: float, ttft_s: float | None, finish_reason: str | None
    ) -> None:
        """Record one request that ended (``finish_reason`` None counts as 'abort')."""
        self.e2e_latency.observe(e2e_s)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        self.requests.labels(finished_reason=finish_reason or "abort").inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
