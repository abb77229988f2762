"""The worker's Prometheus metrics, served on 127.0.0.1 (``--http-port``).

The runner only keeps plain counters; the process loop calls ``observe_step`` after
each step to turn them into metrics (STYLE.md rule 5: no metrics in hot loops). Each
worker has its own registry, so nothing here is global.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class WorkerMetrics:
    def __init__(self, model_name: str = "kvpool-tiny", engine: str = "0"):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": engine}
        names = list(labels)
        self.step_duration = Histogram(
            "kvpool_worker_step_duration_seconds",
            "Seconds the worker spent executing a step (apply + forward + sample).",
            names, buckets=STEP_BUCKETS, registry=self.registry,
        ).labels(**labels)
        self.steps = Counter(
            "kvpool_worker_steps", "Steps executed.", names, registry=self.registry
        ).labels(**labels)
        self.tokens_computed = Counter(
            "kvpool_worker_tokens_computed", "Tokens run through the model (prefill and decode).",
            names, registry=self.registry,
        ).labels(**labels)
        self.kv_bytes_written = Counter(
            "kvpool_worker_kv_bytes_written", "Bytes of K/V written into the paged cache.",
            names, registry=self.registry,
        ).labels(**labels)
        self.num_blocks = Gauge(
            "kvpool_worker_num_blocks", "KV blocks in this worker's cache (block 0 included).",
            names, registry=self.registry,
        ).labels(**labels)
        self._last_tokens = 0
        self._last_bytes = 0

    def observe_step(self, seconds: float, num_tokens_computed: int, kv_bytes_written: int) -> None:
        """Record one step; the two counts are the runner's running totals."""
        self.step_duration.observe(seconds)
        self.steps.inc()
        self.tokens_computed.inc(num_tokens_computed - self._last_tokens)
        self.kv_bytes_written.inc(kv_bytes_written - self._last_bytes)
        self._last_tokens, self._last_bytes = num_tokens_computed, kv_bytes_written

    def reset_totals(self) -> None:
        """Call when a new runner (counting from 0) replaces the old one."""
        self._last_tokens = self._last_bytes = 0

    def serve(self, port: int, host: str = "127.0.0.1"):
        """Start the /metrics HTTP server in a daemon thread; returns the server."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
