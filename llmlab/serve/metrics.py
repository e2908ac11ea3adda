"""Prometheus metrics of the server (``GET /metrics``, text exposition format).

Gauges are read when scraped: requests running and waiting, KV blocks referenced by
live sequences (blocks held only by the prefix cache count as free), and the prefix
cache's hit rate (prompt tokens served from it over prompt tokens looked up, notebook
13). Histograms take one
observation per finished completion: TTFT, TPOT and end-to-end latency, measured on the
engine clock from the request's arrival. Counters add up prompt and generated tokens and
finished requests by reason. Each server has its own registry, so two servers in one
process (tests) do not collide. Names follow Prometheus's conventions
(https://prometheus.io/docs/practices/naming/). Taught in notebook 10.
"""
from __future__ import annotations

import math
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

# seconds; TTFT and e2e on a CPU range from tens of ms to tens of seconds
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)


class ServerMetrics:
    """The server's metrics in their own registry; ``render()`` gives the scrape body."""

    def __init__(self, running: Callable[[], int], waiting: Callable[[], int],
                 kv_blocks_used: Callable[[], int], prefix_cache: Callable | None = None):
        self.registry = r = CollectorRegistry()
        Gauge("llmlab_requests_running", "Requests with a seat in the running batch",
              registry=r).set_function(running)
        Gauge("llmlab_requests_waiting", "Requests queued for a seat (bounded)",
              registry=r).set_function(waiting)
        Gauge("llmlab_kv_blocks_used", "KV-cache blocks referenced by live sequences",
              registry=r).set_function(kv_blocks_used)
        if prefix_cache is not None:    # () -> the block manager's PrefixCacheStats
            Gauge("llmlab_prefix_cache_hit_rate", "Prompt tokens served from the prefix "
                  "cache over prompt tokens looked up, since start",
                  registry=r).set_function(lambda: prefix_cache().hit_rate)
            Gauge("llmlab_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                  "prefix cache, since start", registry=r).set_function(
                      lambda: prefix_cache().queries)
            Gauge("llmlab_prefix_cache_hit_tokens", "Prompt tokens served from the prefix "
                  "cache, since start", registry=r).set_function(lambda: prefix_cache().hits)
        self.ttft = Histogram("llmlab_time_to_first_token_seconds",
                              "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("llmlab_time_per_output_token_seconds",
                              "Mean time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("llmlab_e2e_request_latency_seconds",
                             "Arrival to last token", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("llmlab_prompt_tokens", "Prompt tokens of admitted "
                                     "requests", registry=r)
        self.generation_tokens = Counter("llmlab_generation_tokens", "Tokens generated",
                                         registry=r)
        self.finished = Counter("llmlab_requests_finished", "Finished requests",
                                ["finish_reason"], registry=r)

    def observe(self, m, finish_reason: str | None) -> None:
        """One finished completion's :class:`~llmlab.profiling.metrics.RequestMetrics`;
        an aborted one (its client went away) is only counted, not timed."""
        self.finished.labels(finish_reason or "error").inc()
        if finish_reason == "abort":
            return
        for hist, value in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_s)):
            if not math.isnan(value):
                hist.observe(value)
        self.generation_tokens.inc(m.output_tokens)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["ServerMetrics", "LATENCY_BUCKETS", "TPOT_BUCKETS"]
