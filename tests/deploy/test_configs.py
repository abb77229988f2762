"""deploy/ configuration: promtool checks, and every metric the dashboard and the alerts
use is one kvpool exports."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROM = DEPLOY / "prometheus"

# What the scheduler (:8000) and the worker (:8001) export, as exposed (counters with _total).
# NOTE: hard-coded from the interface; to be checked against the real /metrics later.
COUNTERS = {
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "kvpool_evictions_total",
    "kvpool_steps_total",
    "kvpool_plan_bytes_total",
    "kvpool_worker_tokens_computed_total",
    "kvpool_worker_kv_bytes_written_total",
}
GAUGES = {
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "kvpool_free_cached_blocks",
    "kvpool_num_gpu_blocks",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "kvpool_step_duration_seconds",
    "kvpool_worker_step_duration_seconds",
}
EXPORTED = (
    COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")} | {"up"}
)

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (inside {...} or by (...)) or durations."""
    e = re.sub(r'"[^"]*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?", e):
        name, call = m.group(1), m.group(2)
        if not call and name not in _KEYWORDS:
            names.add(name)
    return names


def test_metric_names_parser():
    e = 'histogram_quantile(0.99, sum by (le) (rate(vllm:x_bucket{a=~"$m"}[$__rate_interval]))) / on(instance) up'
    assert metric_names(e) == {"vllm:x_bucket", "up"}
    assert metric_names("deriv(a[10m]) > 0 and b > 1.5") == {"a", "b"}


def _grafana() -> dict:
    return json.loads((DEPLOY / "grafana" / "kvpool.json").read_text())


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
    ):
        assert needed in text
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def _rule_exprs(path: Path) -> list[str]:
    """`expr:` values of a rules file (inline or a `>-` block), without a YAML library."""
    exprs, lines = [], path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)expr:\s*(.*)$", line)
        if not m:
            continue
        indent, value = len(m.group(1)), m.group(2).strip()
        if value in (">-", ">", "|", "|-"):
            block = []
            for nxt in lines[i + 1 :]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                block.append(nxt.strip())
            value = " ".join(block)
        exprs.append(value)
    return exprs


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


@pytest.mark.parametrize("unit", ["kvpool-scheduler.service", "kvpool-worker.service"])
def test_systemd_units(unit):
    text = (DEPLOY / "systemd" / unit).read_text()
    for section in ("[Unit]", "[Service]", "[Install]"):
        assert section in text
    assert "Restart=on-failure" in text and "127.0.0.1" in text
    if unit == "kvpool-worker.service":
        assert "Requires=kvpool-scheduler.service" in text
        assert "After=kvpool-scheduler.service" in text
