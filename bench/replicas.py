"""Replicas and a router as processes, for the benchmarks and end-to-end tests that run
them: `Replica` (one ``kvpool serve`` in its own process group, so a kill takes all of
it), `Router` (``vllm-router``) and the flags that point its ``kv_aware`` policy at each
replica's KV events. The load sent through them: bench/replica_load.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# The recipe's health checking (deploy/README.md): every 2 s, out after 2 failures.
ROUTER_HEALTH_ARGS = ["--health-check-interval-secs", "2", "--health-failure-threshold", "2", "--worker-startup-check-interval", "1"]


def free_port() -> int:
    from frontend.serve.launcher import free_ports

    return free_ports(1)[0]


def router_binary() -> str | None:
    """vllm-router beside this interpreter (the venv's, from the test extra), else on PATH."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def _stop(proc: subprocess.Popen, timeout: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Replica:
    """One ``kvpool serve`` on a free loopback port, in its own session; with
    ``kv_events``, publishing its KV events on another (``kv_events_endpoint``)."""

    def __init__(self, model: Path | str, log_dir: Path, *extra: str, kv_events: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.kv_events_endpoint = f"tcp://127.0.0.1:{free_port()}" if kv_events else None
        if self.kv_events_endpoint is not None:
            extra = (*extra, "--kv-events-endpoint", self.kv_events_endpoint)
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        kvpool = str(Path(sys.executable).with_name("kvpool"))
        argv = [kvpool, "serve", str(model), "--port", str(self.port), "--log-dir", str(self.log_dir), "--device", "cpu",
                "--kv-cache-memory", "8MiB", "--stop-timeout", "5", *extra]
        self._log = open(self.log_dir / "serve.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while http_get(self.url + "/health", 2)[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpool serve exited with {self.proc.returncode}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvpool serve on {self.url} not healthy within {timeout:g} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.log_dir.glob("*.log")))

    def kill(self) -> None:
        """SIGKILL every process of this replica at once (a crashed host, not a shutdown)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self) -> None:
        _stop(self.proc, 20)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything the launcher left behind
        except ProcessLookupError:
            pass
        self._log.close()


def kv_aware_args(replicas: list[Replica], block_size: int, model: str) -> list[str]:
    """vllm-router's flags that point ``kv_aware`` at each replica's KV events.

    NOTE: vllm-router 0.1.17 subscribes to an HTTP worker's events only from these static
    flags: it reads /kv_event_sources and /get_server_info (kvpool answers both as vLLM)
    but spawns no subscriber for an HTTP worker from them (docs/architecture.md, "KV-aware
    routing")."""
    args = []
    for r in replicas:
        if r.kv_events_endpoint is None:
            raise ValueError(f"replica {r.url} publishes no KV events (Replica(..., kv_events=True))")
        args += ["--kv-event-source", f"{r.url}={r.kv_events_endpoint}"]
    return args + ["--kv-event-block-size", str(block_size), "--kv-event-model", model]


class Router:
    """``vllm-router`` over ``worker_urls`` on a free loopback port (metrics on another)."""

    def __init__(self, worker_urls: list[str], policy: str, log_path: Path, *extra: str, log_level: str = "warning"):
        binary = router_binary()
        if binary is None:
            raise FileNotFoundError("vllm-router not found (pip install vllm-router, or `make install`: the test extra has it)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        # NOTE: no worker URLs: a PD-mode router (bench/pd_fleet.py) names its engines in ``extra``.
        urls = ["--worker-urls", *worker_urls] if worker_urls else []
        argv = [binary, *urls, "--policy", policy, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), "--log-level", log_level, *extra]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while http_get(self.url + "/readiness", 2)[0] != 200:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm-router not ready within {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        _stop(self.proc, 10)
        self._log.close()
