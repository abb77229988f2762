"""A real Prometheus for tests: `prometheus_server(targets)` starts one scraping the given
`host:port` targets every second, waits until it is ready, offers `query(expr)` over its
HTTP API, and always stops it.

    def test_x(prometheus_server):
        prom = prometheus_server(["127.0.0.1:8000"], rule_files=[RULES])
        value = prom.wait_for_value("vllm:kv_cache_usage_perc", timeout=30)

Prometheus's first sample appears ~6 s after start even at a 1 s interval.
Without the `prometheus` binary the fixture skips, or fails under CI (env CI set).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from kvtest.ports import free_port
from kvtest.real_data import skip_or_fail_under_ci


def require_tool(name: str) -> str:
    """Path of a binary; skip without it, except under CI where it must be installed."""
    path = shutil.which(name)
    if path is None:
        skip_or_fail_under_ci(f"`{name}` not found (Debian: apt-get install prometheus)", "CI must install it (.ci/run does)")
    return path



class PrometheusServer:
    """A Prometheus process on 127.0.0.1:<free port> with a tmp config and TSDB."""

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[str],
        rule_files: Sequence[Path] = (),
        scrape_interval: str = "1s",
        job: str = "test",
    ):
        binary = require_tool("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        rules = "".join(f"  - {json.dumps(str(Path(r).resolve()))}\n" for r in rule_files)
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            + (f"rule_files:\n{rules}" if rules else "")
            + "scrape_configs:\n"
            f"  - job_name: {json.dumps(job)}\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(list(targets))}\n"
        )
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log_tail(self, n: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready within {timeout} s:\n{self.log_tail()}")

    def query(self, expr: str) -> list[dict]:
        """Instant query; the API's `data.result` list ([{"metric": {...}, "value": [t, "v"]}])."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def rules(self) -> list[dict]:
        """Every loaded rule as the API reports it (name, query, health, lastError, ...)."""
        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=5) as r:
            body = json.load(r)
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]

    def wait_for_value(self, expr: str, timeout: float = 30.0) -> float:
        """Poll until `expr` returns a sample; its value (the first series')."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return float(result[0]["value"][1])
            time.sleep(0.5)
        raise TimeoutError(f"{expr!r} returned nothing within {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()


@pytest.fixture
def prometheus_server(tmp_path) -> Iterator[Callable[..., PrometheusServer]]:
    """Factory: `prometheus_server(targets, rule_files=(), scrape_interval="1s", job="test")`, started and ready."""
    started: list[PrometheusServer] = []

    def start(
        targets: Sequence[str], rule_files: Sequence[Path] = (), scrape_interval: str = "1s", job: str = "test"
    ) -> PrometheusServer:
        server = PrometheusServer(
            tmp_path / f"prometheus{len(started)}", targets, rule_files, scrape_interval, job
        )
        started.append(server)
        server.wait_ready()
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def promtool() -> str:
    """Path of promtool (skip without it; fail under CI)."""
    return require_tool("promtool")
