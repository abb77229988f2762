"""deploy/ configuration: promtool checks, and every metric the dashboard and the alerts
use is one kvpool exports."""

from __future__ import annotations

import subprocess

import pytest
from kvtest.deploy_config import (
    DEPLOY,
    INTERNALS_DASHBOARD,
    PROM,
    SHARED_DASHBOARD,
    VLLM_PAGE,
    check_exprs,
    check_variables,
    dashboard_exprs,
    dashboard_variables,
    filter_problems,
    metric_names,
    rule_exprs,
)
from kvtest.deploy_config import grafana_dashboard as _grafana
from kvtest.promql import (
    as_series_query,
    grafana_query,
    matcher_labels,
    metric_uses,
    sample_types,
    use_problem,
)


def test_metric_names_parser():
    e = 'histogram_quantile(0.99, sum by (le) (rate(vllm:x_bucket{a=~"$m"}[$__rate_interval]))) / on(instance) up'
    assert metric_names(e) == {"vllm:x_bucket", "up"}
    assert metric_names("deriv(a[10m]) > 0 and b > 1.5") == {"a", "b"}
    assert metric_uses(e) == [("vllm:x_bucket", ("histogram_quantile", "sum", "rate")), ("up", ())]
    assert metric_uses("max by (instance) (g) / (sum(rate(c_total[5m])))") == [("g", ("max",)), ("c_total", ("", "sum", "rate"))]


def test_uses_are_judged_by_the_type_on_the_page():
    page = ("# TYPE c_total counter\nc_total 1.0\n# TYPE g gauge\ng 1.0\n"
            "# TYPE h histogram\nh_bucket{le=\"+Inf\"} 1.0\nh_count 1.0\nh_sum 1.0\n"
            "# TYPE n_total histogram\nn_total_bucket{le=\"+Inf\"} 1.0\nn_total_count 1.0\nn_total_sum 1.0\n")
    types = sample_types(page)
    ok = ["rate(c_total[1m])", "g", "deriv(g[5m])", "histogram_quantile(0.5, sum by (le) (rate(h_bucket[1m])))",
          "rate(h_sum[1m]) / rate(h_count[1m])", "histogram_quantile(0.5, rate(n_total_bucket[1m]))"]
    for e in ok:
        assert [use_problem(n, f, types) for n, f in metric_uses(e)] == [None] * len(metric_uses(e)), e
    bad = {"rate(g[1m])": "rate() of a gauge", "c_total": "used as a gauge", "histogram_quantile(0.5, rate(c_total[1m]))": "histogram_quantile()",
           "histogram_quantile(0.5, rate(h_count[1m]))": "not a histogram's _bucket", "sum(missing)": "not on the page",
           "rate(n_total[1m])": "not on the page"}
    for e, why in bad.items():
        ((name, functions),) = metric_uses(e)
        assert why in (use_problem(name, functions, types) or ""), e


def test_queries_sent_to_prometheus():
    assert as_series_query("max by (a) (g) > 0.9") == "max by (a) (g) > bool 0.9"
    assert as_series_query('x > 10 and deriv(x[10m]) > 0') == "x > bool 10 and deriv(x[10m]) > bool 0"
    assert as_series_query('up{job=~"k-.*"} == 0') == 'up{job=~"k-.*"} == bool 0'
    assert as_series_query('a{b!="1"} > bool 1') == 'a{b!="1"} > bool 1'
    assert grafana_query('rate(c{m=~"$model_name", i=~"${instance}"}[$__rate_interval])') == 'rate(c{m=~".*", i=~".*"}[1m])'


def test_matcher_labels():
    e = 'sum(rate(a_total{model_name=~"$m", x!="}"}[1m])) / b{le="+Inf"} + c'
    assert matcher_labels(e) == [("a_total", {"model_name", "x"}), ("b", {"le"})]


def test_the_vllm_reference_page_is_vllms():
    text = VLLM_PAGE.read_text()
    assert text.startswith("# vLLM 0.32.0") and "vllm serve" in text.split("\n# HELP", 1)[0]
    types = sample_types(text)
    assert types["vllm:kv_cache_usage_perc"] == ("gauge", "") and types["vllm:prompt_tokens_total"] == ("counter", "_total")
    assert types["vllm:time_to_first_token_seconds_bucket"] == ("histogram", "_bucket")
    assert not any(n.startswith("kvpool_") for n in types)


def test_the_shared_dashboard_uses_only_what_vllm_exposes_with_the_right_types():
    """Against the saved vLLM page (tests/deploy/test_dashboards_live.py checks kvpool's)."""
    dash = _grafana(SHARED_DASHBOARD)
    assert dash["uid"] and dash["title"] and dash["panels"] and dash["schemaVersion"] == 39
    exprs = dashboard_exprs(dash)
    assert len(exprs) >= 10 and all(metric_names(e) for e in exprs)
    assert check_exprs(exprs, VLLM_PAGE.read_text()) == []
    assert check_variables(dash, VLLM_PAGE.read_text()) == []
    text = "\n".join(exprs)
    assert "kvpool_" not in text
    for needed in ("vllm:kv_cache_usage_perc", "rate(vllm:prefix_cache_hits_total", "vllm:num_requests_waiting",
                   "histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket",
                   "vllm:inter_token_latency_seconds_bucket", "vllm:kv_block_lifetime_seconds_bucket",
                   "histogram_quantile(0.99, sum by (le) (rate(vllm:request_queue_time_seconds_bucket",
                   "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
                   "vllm:request_inference_time_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
                   "vllm:iteration_tokens_total_bucket", "rate(vllm:prompt_tokens_cached_total",
                   "sum by (source) (rate(vllm:prompt_tokens_cached_by_source_total",
                   "sum by (reason) (vllm:num_requests_waiting_by_reason", "vllm:request_num_preemptions_bucket",
                   "sum by (reason) (rate(vllm:admission_rejections_total"):
        assert needed in text
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_the_internals_dashboard_holds_kvpools_own_families():
    dash = _grafana(INTERNALS_DASHBOARD)
    assert dash["uid"] != _grafana(SHARED_DASHBOARD)["uid"] and dash["schemaVersion"] == 39
    exprs = dashboard_exprs(dash)
    used = set().union(*(metric_names(e) for e in exprs)) | {m for _, m, _ in dashboard_variables(dash)}
    assert used and all(n.startswith("kvpool_") for n in used), sorted(used)
    text = "\n".join(exprs)
    # What the shared dashboard gave up is here.
    for needed in ("kvpool_free_cached_blocks", "kvpool_step_duration_seconds_bucket", "kvpool_kv_cache_token_usage_perc",
                   "kvpool_peak_kv_cache_usage_perc", "rate(kvpool_prefix_cache_preempted_hits_total",
                   "kvpool_worker_step_duration_seconds_bucket", "kvpool_plan_bytes_total", "kvpool_evictions_total",
                   "rate(kvpool_worker_loss_recomputes_total"):
        assert needed in text
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("name", [SHARED_DASHBOARD, INTERNALS_DASHBOARD])
def test_the_panels_tile_the_grid_without_overlap(name):
    """Grafana's grid is 24 wide: every panel inside it, no two sharing a cell."""
    cells: dict[tuple[int, int], str] = {}
    for panel in _grafana(name)["panels"]:
        g = panel["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0 and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[x, y]!r} at x={x}, y={y}"
                cells[x, y] = panel["title"]


def test_the_shared_dashboards_panels_filter_on_its_variables():
    """Against the saved vLLM page (tests/deploy/test_dashboards_live.py checks both
    dashboards against kvpool's pages)."""
    assert filter_problems(_grafana(SHARED_DASHBOARD), VLLM_PAGE.read_text()) == []
    # The check sees a selector that leaves a variable out.
    page = "# TYPE vllm:g gauge\nvllm:g{model_name=\"m\"} 1.0\n"
    dash = {"panels": [{"title": "t", "targets": [{"expr": 'vllm:g{instance=~"$instance"}'}, {"expr": "vllm:g"}]}]}
    assert filter_problems(dash, page) == ["t: vllm:g{...} does not match model_name", "t: vllm:g has no matcher"]
    worker = {"panels": [{"title": "w", "targets": [{"expr": 'rate(vllm:g{instance=~"$worker_instance"}[1m])'}]}]}
    assert filter_problems(worker, page) == []


def test_alert_rules_use_only_what_vllm_exposes():
    exprs = rule_exprs(PROM / "rules.yml")
    assert len(exprs) >= 3
    assert check_exprs(exprs, VLLM_PAGE.read_text()) == []
    used = set().union(*(metric_names(e) for e in exprs))
    assert {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting", "vllm:num_preemptions_total",
            "vllm:request_queue_time_seconds_bucket"} <= used


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

    from frontend.serve.cli import build_parser

    text = (DEPLOY / "systemd" / "kvpool-serve.service").read_text()
    start = text.split("ExecStart=", 1)[1].split("\n", 1)[0]
    cmd = text[text.index(start):].split("\n# ", 1)[0].replace("\\\n", " ")
    argv = shlex.split(cmd)[1:]  # after the kvpool binary
    args = build_parser().parse_args(argv)  # exits 2 on an unknown flag
    assert args.command == "serve" and args.port == 8000 and args.worker_http_port == 8001

