"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "ds4serve_"
        self.requests = Counter(
            p + "requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.finished = Counter(
            p + "generations", "Generations by finish reason", ["finish_reason"], registry=r
        )
        self.cancelled = Counter(
            p + "cancelled",
            "Generations cancelled (client disconnect, shutdown, park)",
            ["reason"],
            registry=r,
        )
        self.preemptions = Counter(
            p + "preemptions",
            "Running requests taken off the engine (state kept on the host) for requests of a higher priority",
            registry=r,
        )
        self.tokens_after_cancel = Counter(
            p + "tokens_after_cancel",
            "Tokens generated after a cancel request "
            "(the engine stops before its next forward: at most one each)",
            registry=r,
        )
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.prefilled_tokens = Counter(
            p + "prefilled_tokens", "Prompt tokens actually forwarded", registry=r
        )
        self.cached_tokens = Counter(
            p + "cached_tokens", "Prompt tokens restored from the prefix cache", registry=r
        )
        self.generated_tokens = Counter(p + "generated_tokens", "Generated tokens", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge(p + "running", "Requests running on the engine", registry=r)
        self.ttft = Histogram(
            p + "time_to_first_token_seconds",
            "Time from admission to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            p + "inter_token_seconds", "Time between consecutive tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            p + "queue_wait_seconds",
            "Time spent waiting for the engine",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_batch_size = Histogram(
            p + "step_batch_size",
            "Sequences per decode step",
            buckets=(1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256),
            registry=r,
        )
        self.spec_proposed = Counter(p + "speculative_proposed_tokens", "Draft tokens proposed", registry=r)
        self.spec_accepted = Counter(p + "speculative_accepted_tokens", "Draft tokens accepted", registry=r)
        self.cache_hits = Counter(
            p + "prefix_cache_hits", "Requests that restored a cached prefix", registry=r
        )
        self.cache_misses = Counter(p + "prefix_cache_misses", "Requests with no cached prefix", registry=r)
        self.cache_bytes = Gauge(
            p + "prefix_cache_bytes", "Bytes of snapshots held by the prefix cache", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
