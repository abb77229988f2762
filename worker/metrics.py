"""The worker's Prometheus metrics and health, served on 127.0.0.1 (``--http-port``):
GET /metrics, GET /health (200 once WorkerReady is installed, else 503), 404 elsewhere.

The runner only keeps plain counters; the process loop calls ``observe_step`` after
each step to turn them into metrics (STYLE.md rule 5: no metrics in hot loops). Each
worker has its own registry, so nothing here is global.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

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
        # Set by the process loop: True while a scheduler's WorkerReady is installed.
        self.ready = False

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

    def serve(self, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
        """Start the HTTP server in a daemon thread; returns the server (OSError if the
        port is taken)."""
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(metrics.registry), CONTENT_TYPE_LATEST)
                elif path == "/health":
                    ok = metrics.ready
                    self._reply(200 if ok else 503, b"ok\n" if ok else b"not ready: no WorkerReady from a scheduler\n")
                else:
                    self._reply(404, b"not found: GET /metrics or /health\n")

            def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args) -> None:
                pass  # no access log

        server = ThreadingHTTPServer((host, port), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="worker-http", daemon=True).start()
        return server
