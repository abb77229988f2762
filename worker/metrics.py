"""The worker's Prometheus metrics and health, served on 127.0.0.1 (``--http-port``):
GET /metrics, GET /health (200 once WorkerReady is installed, else 503), 404 elsewhere.

The runner only keeps plain counters; the process loop calls ``observe_step`` after
each step to turn them into metrics (STYLE.md rule 5: no metrics in hot loops). Each
worker has its own registry, so nothing here is global.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from worker.cpu.threads import StepThreads
from worker.external.external_io import ExternalIO
from worker.external.io_metrics import ExternalIOCollector
from worker.transfer.kv_transfer import KVTransfer
from worker.transfer.transfer_metrics import KVTransferCollector

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Bytes of one step's copies in one direction: vLLM's offloading connector's buckets.
TRANSFER_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
# vLLM's transfer_type label values (its deprecated kv_offload_total_* counters).
LOAD_TRANSFER_TYPE, STORE_TRANSFER_TYPE = "CPU_to_GPU", "GPU_to_CPU"


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
        self._offload_metrics(names, labels)
        self._labels = labels
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

    def _offload_metrics(self, names: list[str], labels: dict[str, str]) -> None:
        """The host tier's copies, under the names of vLLM's offloading connector
        (vllm/distributed/kv_transfer/kv_connector/v1/offloading/metrics.py): the flat
        load/store counters and size histograms, and the older total_bytes/total_time
        counters by transfer_type that dashboards still read."""
        r = self.registry
        self.offload = {}
        for kind, what in (("load", "loaded from the host tier to the device"), ("store", "stored from the device to the host tier")):
            self.offload[f"{kind}_bytes"] = Counter(f"vllm:kv_offload_{kind}_bytes", f"Total bytes {what}.", names, registry=r).labels(**labels)
            self.offload[f"{kind}_time"] = Counter(f"vllm:kv_offload_{kind}_time", f"Total seconds of copies {what}.", names, registry=r).labels(**labels)
            self.offload[f"{kind}_size"] = Histogram(
                f"vllm:kv_offload_{kind}_size", f"Bytes {what} in one step.", names, buckets=TRANSFER_SIZE_BUCKETS, registry=r,
            ).labels(**labels)
        total_bytes = Counter("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector", [*names, "transfer_type"], registry=r)
        total_time = Counter("vllm:kv_offload_total_time", "Total time measured by all KV offloading operations", [*names, "transfer_type"], registry=r)
        for kind, transfer in (("load", LOAD_TRANSFER_TYPE), ("store", STORE_TRANSFER_TYPE)):
            self.offload[f"{kind}_total_bytes"] = total_bytes.labels(**labels, transfer_type=transfer)
            self.offload[f"{kind}_total_time"] = total_time.labels(**labels, transfer_type=transfer)
        self.host_kv_bytes = Gauge(
            "kvpool_worker_host_kv_bytes", "Bytes of host memory allocated for the offload tier (--kv-offloading-size).",
            names, registry=r,
        ).labels(**labels)
        self.num_host_blocks = Gauge(
            "kvpool_worker_num_host_blocks", "Host-tier KV slots the scheduler manages (WorkerReady num_host_blocks).",
            names, registry=r,
        ).labels(**labels)
        self._last_offload = (0, 0.0, 0, 0.0)

    def observe_tier(self, store_bytes: int, store_seconds: float, load_bytes: int, load_seconds: float) -> None:
        """Record one step's host-tier copies; the four figures are the copier's running
        totals (worker/kv/tier_copies.py)."""
        now = (store_bytes, store_seconds, load_bytes, load_seconds)
        sb, ss, lb, ls = (a - b for a, b in zip(now, self._last_offload, strict=True))
        self._last_offload = now
        for kind, nbytes, seconds in (("store", sb, ss), ("load", lb, ls)):
            if nbytes:
                o = self.offload
                o[f"{kind}_bytes"].inc(nbytes)
                o[f"{kind}_total_bytes"].inc(nbytes)
                o[f"{kind}_time"].inc(seconds)
                o[f"{kind}_total_time"].inc(seconds)
                o[f"{kind}_size"].observe(nbytes)

    def watch_step_threads(self, threads: StepThreads) -> None:
        """Report the CPU worker's big steps from ``threads`` (worker/cpu/threads.py), read at
        each scrape: how many went wide, whether one would now, and the neighbours' load."""
        self.registry.register(_StepThreadsCollector(threads, self._labels))

    def watch_external(self, io: ExternalIO) -> None:
        """Report the external tier's saves and loads (worker/external/io_metrics.py), read at each scrape."""
        self.registry.register(ExternalIOCollector(io, self._labels))

    def watch_kv_transfer(self, transfer: KVTransfer) -> None:
        """Report P/D disaggregation's pulls and served reads (worker/transfer/transfer_metrics.py), read at each scrape."""
        self.registry.register(KVTransferCollector(transfer, self._labels))

    def reset_totals(self) -> None:
        """Call when a new runner (counting from 0) replaces the old one."""
        self._last_tokens = self._last_bytes = 0
        self._last_offload = (0, 0.0, 0, 0.0)

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


class _StepThreadsCollector(Collector):
    def __init__(self, threads: StepThreads, labels: dict[str, str]):
        self.threads = threads
        self.names, self.values = list(labels), list(labels.values())

    def collect(self) -> Iterator:
        t = self.threads
        wide = CounterMetricFamily("kvpool_worker_wide_steps", "Steps run on every core (big steps, --cpu-wide-step-tokens).",
                                   labels=self.names)
        wide.add_metric(self.values, t.num_wide_steps)
        allowed = GaugeMetricFamily(
            "kvpool_worker_wide_steps_allowed",
            "1 while a big step would run on every core: no other process keeps a core busy (worker/cpu/host_load.py) "
            "and no other kvpool worker runs on this host (worker/cpu/host_peers.py), as of their last looks.",
            labels=self.names,
        )
        allowed.add_metric(self.values, float(t.wide_allowed))
        others = GaugeMetricFamily(
            "kvpool_worker_cpu_neighbour_cores",
            "Cores' worth of CPU time used by processes other than this serve's, at the last look (worker/cpu/host_load.py).",
            labels=self.names,
        )
        others.add_metric(self.values, t.load.others_cores if t.load is not None else 0.0)
        yield from (wide, allowed, others)
