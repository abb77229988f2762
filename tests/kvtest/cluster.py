"""Real processes over real sockets for end-to-end tests: a scheduler and a CPU
worker on free loopback ports, a blocking client, /metrics parsing.

`Cluster` is a context manager: it always stops both processes (SIGTERM, then
SIGKILL after a bound), also when the test fails; every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvtest.ports import free_port  # noqa: F401 (re-exported for the tests that import it from here)
from protocol.client_messages import ClientResponse, EngineCoreOutputs, Generate, RequestError
from protocol.codec import Codec

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprobs, when the request asked


class Cluster:
    def __init__(self, scheduler_args=(), worker_args=(), start_worker=True, log_dir: Path | None = None):
        self.port, self.worker_port, self.http_port = free_port(), free_port(), free_port()
        self.scheduler_args = list(scheduler_args)
        self.worker_args = list(worker_args)
        self.start_worker = start_worker
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.ctx = zmq.Context()
        self.codec: Codec = Codec(ClientResponse)

    # --- processes --------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.log_dir / f"{name}.log", "wb") if self.log_dir else subprocess.DEVNULL
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def start_scheduler(self) -> None:
        self._spawn("scheduler", ["-m", "scheduler", "--port", str(self.port), "--worker-port", str(self.worker_port),
                                  "--http-port", str(self.http_port), "--log-level", "WARNING", *self.scheduler_args])

    def spawn_worker(self, name: str = "worker", extra=()) -> subprocess.Popen:
        return self._spawn(name, ["-m", "worker", "--scheduler", f"tcp://127.0.0.1:{self.worker_port}", "--device", "cpu",
                                  "--http-port", "0", "--log-level", "WARNING", *self.worker_args, *extra])

    def __enter__(self) -> Cluster:
        try:
            self.start_scheduler()
            if self.start_worker:
                self.spawn_worker()
                self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def health(self) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        # Processes a test killed on purpose before this call are not watched.
        watched = {name: p for name, p in self.procs.items() if p.poll() is None}
        while time.monotonic() < deadline:
            for name, p in watched.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} before the cluster was ready")
            if self.health() == 200:
                return
            time.sleep(0.2)
        raise TimeoutError(f"/health not 200 within {timeout} s")

    def stop(self, timeout: float = 10.0) -> dict[str, int]:
        codes = {}
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[name] = p.wait(timeout)
        self.ctx.destroy(linger=0)
        return codes

    # --- clients ----------------------------------------------------------------------

    def client(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        return sock

    def generate(self, requests: list[Generate], timeout: float = 120.0, sock: zmq.Socket | None = None) -> dict[str, Result]:
        """Send every request at once on one socket; collect until all have ended."""
        own = sock is None
        sock = sock or self.client()
        try:
            for g in requests:
                sock.send(self.codec.encode(g))
            results = {g.request_id: Result(g.request_id) for g in requests}
            pending = set(results)
            deadline = time.monotonic() + timeout
            while pending:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000)):
                    raise TimeoutError(f"{len(pending)} requests unfinished after {timeout} s: {sorted(pending)[:5]}")
                msg = self.codec.decode(sock.recv())
                match msg:
                    case EngineCoreOutputs(outputs=outputs):
                        for out in outputs:
                            r = results[out.request_id]
                            r.token_ids.extend(out.new_token_ids)
                            r.num_cached_tokens = out.num_cached_tokens
                            r.logprobs.extend(out.logprobs or ())
                            if out.finished:
                                r.finish_reason = out.finish_reason
                                pending.discard(out.request_id)
                    case RequestError():
                        if msg.request_id in results:
                            results[msg.request_id].error = msg.message
                            pending.discard(msg.request_id)
                        else:
                            raise AssertionError(f"unexpected error: {msg.message}")
            return results
        finally:
            if own:
                sock.close(linger=0)

    # --- metrics ----------------------------------------------------------------------

    def metrics_text(self, port: int | None = None) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port or self.http_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """Sample name -> value (labels dropped; counters keep their _total name)."""
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    continue
                out[s.name] = s.value
        return out
