"""What deploy/ (the Grafana dashboard, the alert rules) expects kvpool to export,
and a small PromQL reader to find the metric names an expression uses. Shared by
the static config tests and the live Prometheus test, which checks the same set
against the real /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PROM = DEPLOY / "prometheus"

# What the scheduler (:8000) and the worker (:8001) export, as exposed (counters with _total).
# NOTE: tests/deploy/test_prometheus_live.py checks this set against the real /metrics.
COUNTERS = {
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "kvpool_prefix_cache_preempted_queries_total",
    "kvpool_prefix_cache_preempted_hits_total",
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
    "kvpool_peak_kv_cache_usage_perc",
    "kvpool_kv_cache_token_usage_perc",
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "kvpool_step_duration_seconds",
    "kvpool_worker_step_duration_seconds",
    # Only with the scheduler's --kv-cache-metrics (the live test turns it on).
    "vllm:kv_block_lifetime_seconds",
    "vllm:kv_block_idle_before_evict_seconds",
    "vllm:kv_block_reuse_gap_seconds",
}
# What `kvpool serve`'s API adds on its /metrics (the frontend), beside the scheduler's.
# NOTE: tests/frontend/test_api_errors.py checks these against a live kvpool serve.
FRONTEND = {"vllm:request_success_total", "http_requests_total"}
EXPORTED = (
    COUNTERS | GAUGES | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")} | {"up"} | FRONTEND
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


def grafana_dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "kvpool.json").read_text())


def rule_exprs(path: Path) -> list[str]:
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




def dashboard_metric_names() -> set[str]:
    dash = grafana_dashboard()
    used: set[str] = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= metric_names(target["expr"])
    for var in dash["templating"]["list"]:
        m = re.match(r"label_values\(([^,]+),", var["query"]["query"])
        if m:
            used.add(m.group(1).strip())
    return used
