"""A real Prometheus server scraping a running scheduler and worker: it finds what
the scheduler reports, and every metric deploy/ relies on really exists."""

from __future__ import annotations

import random
import time

import pytest
from kvtest.cluster import Cluster, free_port
from kvtest.deploy_config import (
    FRONTEND,
    INTERNALS_DASHBOARD,
    PROM,
    dashboard_metric_names,
    metric_names,
    rule_exprs,
)
from prometheus_client.parser import text_string_to_metric_families

from protocol.client_messages import Abort, Generate

pytestmark = pytest.mark.e2e


def _names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_prometheus_scrapes_what_the_scheduler_reports(prometheus_server, tmp_path):
    worker_http = free_port()
    # A long max_model_len and a cache to match: one request decodes for minutes (it
    # is aborted long before it ends) while Prometheus scrapes.
    with Cluster(["--max-model-len", "131072", "--kv-cache-metrics"], ["--http-port", str(worker_http), "--kv-cache-memory", "256MiB"], log_dir=tmp_path) as c:
        rng = random.Random(0)
        prefix = [rng.randrange(2, 512) for _ in range(32)]
        # Two rounds of requests sharing a prefix: queries and hits both move.
        c.generate([Generate(f"a{i}", prefix + [rng.randrange(2, 512) for _ in range(8)], 4, ignore_eos=True) for i in range(4)])
        c.generate([Generate(f"b{i}", prefix + [rng.randrange(2, 512) for _ in range(8)], 4, ignore_eos=True) for i in range(4)])
        sock = c.client()
        try:
            # A request that holds blocks while Prometheus scrapes: usage > 0.
            sock.send(c.codec.encode(Generate("long", [rng.randrange(2, 512) for _ in range(40)], 120_000, ignore_eos=True)))
            assert sock.poll(30_000), "no first token"
            reported = c.metrics()
            assert reported["vllm:kv_cache_usage_perc"] > 0, "the long request holds no block"
            queries = reported["vllm:prefix_cache_queries_total"]
            assert queries == 8 * 40 + 40
            hits = reported["vllm:prefix_cache_hits_total"]
            assert hits == 7 * 32  # every request after the first hits the 2-block prefix

            prom = prometheus_server([f"127.0.0.1:{c.http_port}", f"127.0.0.1:{worker_http}"])
            assert prom.wait_for_value('vllm:prefix_cache_queries_total{model_name="kvpool-tiny"}', timeout=40) == queries
            assert prom.wait_for_value("vllm:prefix_cache_hits_total", timeout=10) == hits
            # Usage while the long request runs: what the scheduler reported, or a bit
            # more (it grows by a block every 16 tokens).
            usage = prom.wait_for_value("vllm:kv_cache_usage_perc > 0", timeout=20)
            assert reported["vllm:kv_cache_usage_perc"] <= usage <= c.metrics()["vllm:kv_cache_usage_perc"]
            # Both targets are up.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and len(prom.query("up == 1")) < 2:
                time.sleep(0.5)
            assert len(prom.query("up == 1")) == 2
            real = _names(c.metrics_text()) | _names(c.metrics_text(worker_http)) | {"up"}

            # Abort it: the scheduler reports 0 and Prometheus sees the same.
            sock.send(c.codec.encode(Abort("long")))
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and c.metrics()["vllm:kv_cache_usage_perc"] != 0:
                time.sleep(0.2)
            assert c.metrics()["vllm:kv_cache_usage_perc"] == 0
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and prom.query("vllm:kv_cache_usage_perc == 0") == []:
                time.sleep(0.5)
            assert prom.wait_for_value("vllm:kv_cache_usage_perc == 0", timeout=1) == 0
        finally:
            sock.close(linger=0)
    # Every metric the dashboards and the alerts use exists in the real /metrics.
    used = dashboard_metric_names() | dashboard_metric_names(INTERNALS_DASHBOARD)
    for expr in rule_exprs(PROM / "rules.yml"):
        used |= metric_names(expr)
    # NOTE: the frontend's names are only on kvpool serve's API (tests/deploy/test_dashboards_live.py).
    frontend = FRONTEND | {n for n in used if n.startswith("kvpool_frontend_")}
    assert used - frontend <= real, f"deploy/ uses metrics nobody exports: {sorted(used - frontend - real)}"
