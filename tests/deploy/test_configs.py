"""deploy/ configuration: promtool checks, and every metric the dashboard and the alerts
use is one kvpool exports."""

from __future__ import annotations

import re
import subprocess

import pytest
from kvtest.deploy_config import DEPLOY, EXPORTED, PROM, metric_names
from kvtest.deploy_config import grafana_dashboard as _grafana
from kvtest.deploy_config import rule_exprs as _rule_exprs


def test_metric_names_parser():
    e = 'histogram_quantile(0.99, sum by (le) (rate(vllm:x_bucket{a=~"$m"}[$__rate_interval]))) / on(instance) up'
    assert metric_names(e) == {"vllm:x_bucket", "up"}
    assert metric_names("deriv(a[10m]) > 0 and b > 1.5") == {"a", "b"}


def test_grafana_dashboard_parses_and_uses_exported_metrics():
    dash = _grafana()
    assert dash["uid"] and dash["title"] and dash["panels"]
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        used |= names
    for var in dash["templating"]["list"]:
        m = re.match(r"label_values\(([^,]+),", var["query"]["query"])
        assert m, var
        used.add(m.group(1).strip())
    assert used <= EXPORTED, f"not exported: {sorted(used - EXPORTED)}"
    # the panels the dashboard promises
    text = "\n".join(exprs)
    for needed in (
        "vllm:kv_cache_usage_perc",
        "kvpool_free_cached_blocks",
        "rate(vllm:prefix_cache_hits_total",
        "vllm:num_requests_waiting",
        "histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "kvpool_step_duration_seconds_bucket",
        "kvpool_kv_cache_token_usage_perc",
        "kvpool_peak_kv_cache_usage_perc",
        "rate(kvpool_prefix_cache_preempted_hits_total",
        "vllm:kv_block_lifetime_seconds_bucket",
    ):
        assert needed in text
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_alert_rules_use_exported_metrics():
    exprs = _rule_exprs(PROM / "rules.yml")
    assert len(exprs) >= 3
    used = set().union(*(metric_names(e) for e in exprs))
    assert used <= EXPORTED, f"not exported: {sorted(used - EXPORTED)}"
    assert {
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
    } <= used


def _promtool(promtool: str, *args: str) -> None:
    p = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=DEPLOY)
    assert p.returncode == 0, p.stdout + p.stderr


def test_promtool_check_rules(promtool):
    _promtool(promtool, "check", "rules", str(PROM / "rules.yml"))


def test_promtool_check_config(promtool):
    _promtool(promtool, "check", "config", str(PROM / "prometheus.yml"))


def test_promtool_alert_unit_tests(promtool):
    _promtool(promtool, "test", "rules", str(PROM / "rules_test.yml"))


def test_prometheus_config_scrapes_both_processes():
    text = (PROM / "prometheus.yml").read_text()
    assert "127.0.0.1:8000" in text and "127.0.0.1:8001" in text and "rules.yml" in text


@pytest.mark.parametrize("unit", ["kvpool-scheduler.service", "kvpool-worker.service", "kvpool-serve.service"])
def test_systemd_units(unit):
    text = (DEPLOY / "systemd" / unit).read_text()
    for section in ("[Unit]", "[Service]", "[Install]"):
        assert section in text
    assert "Restart=on-failure" in text and "127.0.0.1" in text
    if unit == "kvpool-worker.service":
        assert "Requires=kvpool-scheduler.service" in text
        assert "After=kvpool-scheduler.service" in text
    if unit == "kvpool-serve.service":
        assert "kvpool serve " in text and "--port 8000" in text and "--worker-http-port 8001" in text
        assert "Conflicts=kvpool-scheduler.service kvpool-worker.service" in text


def test_the_serve_unit_uses_only_flags_kvpool_serve_has():
    import shlex

    from frontend.cli import build_parser

    text = (DEPLOY / "systemd" / "kvpool-serve.service").read_text()
    start = text.split("ExecStart=", 1)[1].split("\n", 1)[0]
    cmd = text[text.index(start):].split("\n# ", 1)[0].replace("\\\n", " ")
    argv = shlex.split(cmd)[1:]  # after the kvpool binary
    args = build_parser().parse_args(argv)  # exits 2 on an unknown flag
    assert args.command == "serve" and args.port == 8000 and args.worker_http_port == 8001

