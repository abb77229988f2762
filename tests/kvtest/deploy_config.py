"""What deploy/ (the Grafana dashboards, the alert rules) asks of the engines it watches:
the expressions of each dashboard and rules file, the metrics they name, and the pages
they are checked against -- vLLM 0.32's saved /metrics page (tests/deploy/data) and a
live kvpool's. Nothing here lists metrics by hand: the requirement comes from the
dashboards and rules, the answer from the pages."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvtest.promql import (
    PROMETHEUS_OWN,
    TARGET_LABELS,
    matcher_labels,
    metric_names,
    metric_uses,
    sample_labels,
    sample_types,
    use_problem,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
# The dashboard a vLLM operator's setup uses (families both engines expose), and the one of
# kvpool's own families (kvpool_*).
SHARED_DASHBOARD, INTERNALS_DASHBOARD = "kvpool.json", "kvpool-internals.json"
# vLLM 0.32's /metrics after a short workload; its header says how it was made.
VLLM_PAGE = ROOT / "tests/deploy/data/vllm-0.32-metrics.txt"

# What `kvpool serve`'s API adds on its /metrics (the frontend), beside the scheduler's.
# NOTE: tests/frontend/test_api_errors.py checks these against a live kvpool serve.
FRONTEND = {"vllm:request_success_total", "http_requests_total", "vllm:request_prompt_tokens_bucket",
            "vllm:request_generation_tokens_bucket"}


def grafana_dashboard(name: str = SHARED_DASHBOARD) -> dict:
    return json.loads((GRAFANA / name).read_text())


def dashboard_exprs(dash: dict) -> list[str]:
    """Every panel target's expression."""
    return [t["expr"] for panel in dash["panels"] for t in panel["targets"]]


def dashboard_variables(dash: dict) -> list[tuple[str, str, str]]:
    """(variable, metric, label) of each `label_values(metric, label)` variable."""
    out = []
    for var in dash["templating"]["list"]:
        m = re.fullmatch(r"label_values\(\s*([^,\s]+)\s*,\s*(\w+)\s*\)", var["query"]["query"])
        if m is None:
            raise ValueError(f"variable {var['name']}: not a label_values(metric, label) query: {var['query']['query']!r}")
        out.append((var["name"], m.group(1), m.group(2)))
    return out


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


def dashboard_metric_names(name: str = SHARED_DASHBOARD) -> set[str]:
    """Every metric a dashboard's targets and variables name."""
    dash = grafana_dashboard(name)
    used = set().union(*(metric_names(e) for e in dashboard_exprs(dash)))
    return used | {metric for _, metric, _ in dashboard_variables(dash)}


def check_exprs(exprs: list[str], page: str) -> list[str]:
    """What is wrong with the expressions on one exposition page: each metric missing or
    of the wrong type for the function around it, each matcher on a label it lacks."""
    types, labels = sample_types(page), sample_labels(page)
    problems = [p for e in exprs for n, f in metric_uses(e) if n not in PROMETHEUS_OWN for p in [use_problem(n, f, types)] if p]
    for e in exprs:
        for name, used in matcher_labels(e):
            missing = used - labels.get(name, set()) - TARGET_LABELS
            if name in labels and missing:
                problems.append(f"{name}: no label {', '.join(sorted(missing))} (in {e!r})")
    return problems


def check_variables(dash: dict, page: str) -> list[str]:
    """Each label_values(metric, label) variable whose metric or label is not on the page."""
    labels, out = sample_labels(page), []
    for var, metric, label in dashboard_variables(dash):
        if metric not in labels:
            out.append(f"variable {var}: {metric} is not on the page")
        elif label not in labels[metric] | TARGET_LABELS:
            out.append(f"variable {var}: {metric} has no label {label}")
    return out


# NOTE: the worker's families carry the worker's own model_name (not the served name the
# model_name variable lists), so a selector on the worker's target is filtered by it alone.
WORKER_TARGET = '"$worker_instance"'


def filter_problems(dash: dict, page: str) -> list[str]:
    """Each panel target's selector that the dashboard's variables do not filter: every
    one must match ``instance`` (the server, or the worker), and ``model_name`` where the
    metric carries it on the page, unless it selects the worker's target."""
    labels, out = sample_labels(page), []
    for panel in dash["panels"]:
        for t in panel["targets"]:
            selectors = selector_matchers(t["expr"])
            bare = metric_names(t["expr"]) - PROMETHEUS_OWN - {name for name, _ in selectors}
            out += [f"{panel['title']}: {name} has no matcher" for name in sorted(bare)]
            for name, body in selectors:
                used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", body))
                need = {"instance"} | ({"model_name"} & labels.get(name, set()) if WORKER_TARGET not in body else set())
                out += [f"{panel['title']}: {name}{{...}} does not match {label}" for label in sorted(need - used)]
    return out


def selector_matchers(expr: str) -> list[tuple[str, str]]:
    """(metric, the text inside its {...}) for each selector with matchers."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr)]
