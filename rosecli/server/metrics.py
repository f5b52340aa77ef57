"""Prometheus metrics of one server: request outcomes and latency histograms observed by the
HTTP handlers, engine gauges (running, waiting, KV blocks, prefix-cache hit rate) read from
``StreamingManager.stats()`` at scrape time. Each app owns its registry, so several servers
in one process (tests) do not collide."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class _EngineCollector:
    def __init__(self, manager):
        self.manager = manager

    def collect(self):
        s = self.manager.stats()
        gauges = (
            ("rose_num_requests_running", "Requests prefilling or decoding.", s["running"]),
            ("rose_num_requests_waiting", "Requests queued for admission.", s["waiting"]),
            ("rose_num_requests_inflight", "Requests submitted and not finished.", s["inflight"]),
            ("rose_kv_blocks_used", "KV cache blocks held by requests.", s["kv_blocks_used"]),
            ("rose_kv_blocks_total", "KV cache blocks in the pool.", s["kv_blocks_total"]),
            ("rose_kv_cache_usage_ratio", "Share of KV cache blocks in use.",
             s["kv_blocks_used"] / s["kv_blocks_total"] if s["kv_blocks_total"] else 0.0),
            ("rose_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens queried.",
             s["prefix_cache_hit_rate"]),
            ("rose_engine_alive", "1 while the engine worker runs, 0 after it died.", int(self.manager.is_alive)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("rose_preemptions", "Requests preempted for lack of KV blocks.",
                                  value=s["preemptions"])
        yield CounterMetricFamily("rose_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
                                  value=s["prefix_cache_hit_tokens"])


class ServerMetrics:
    def __init__(self, manager):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter("rose_requests", "Finished HTTP generation requests by finish reason "
                                "(stop, length, abort: client went away, error).", ["finish_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)
        self.rejected = Counter("rose_requests_rejected", "Requests refused before generation, by HTTP status.",
                                ["status"], registry=r)
        self.prompt_tokens = Counter("rose_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("rose_generation_tokens", "Generated tokens.", registry=r)
        self.ttft = Histogram("rose_time_to_first_token_seconds", "Request arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("rose_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("rose_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.gc_pause = Histogram("rose_gc_pause_seconds", "Python garbage collections of the server process "
                                  "(every thread stops meanwhile), by generation.", ["generation"],
                                  buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0), registry=r)
        r.register(_EngineCollector(manager))

    def finished(self, reason: str, arrival: float, output=None) -> None:
        """Count one request; ``output`` (a RequestOutput) adds its tokens and latencies."""
        self.requests.labels(reason).inc()
        if output is None:
            return
        self.prompt_tokens.inc(output.prompt_tokens)
        self.generation_tokens.inc(output.output_tokens)
        ts = output.timestamps
        first: Optional[float] = ts.first_token
        if first is not None:
            self.ttft.observe(max(0.0, first - arrival))
            if ts.finish is not None and output.output_tokens > 1:
                self.tpot.observe((ts.finish - first) / (output.output_tokens - 1))
        if ts.finish is not None:
            self.e2e.observe(max(0.0, ts.finish - arrival))

    def render(self) -> bytes:
        return generate_latest(self.registry)
