"""deploy/'s dashboards and alert rules against the engines themselves. The shared
dashboard (grafana/kvpool.json) and the rules use only what both engines expose: every
metric they name is on vLLM 0.32's saved /metrics page and on a live `kvpool serve`'s, of
the type the function around it needs, with the labels they match on; the internals
dashboard (kvpool_* families) finds its metrics on kvpool's pages. Then a real Prometheus
scrapes that kvpool serve through a small workload and every expression, every variable
and every rule returns series, the rules evaluated without error. Nothing is listed by
hand: what is needed comes from deploy/, what is there from the pages."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass

import pytest
from kvtest.deploy_config import (
    INTERNALS_DASHBOARD,
    PROM,
    SHARED_DASHBOARD,
    VLLM_PAGE,
    check_exprs,
    check_variables,
    dashboard_exprs,
    dashboard_variables,
    filter_problems,
    grafana_dashboard,
    rule_exprs,
)
from kvtest.http_api import PROMPT, get_metrics, metric, post
from kvtest.ports import free_port
from kvtest.promql import as_series_query, grafana_query
from kvtest.serve import Served, kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RULES = PROM / "rules.yml"


@dataclass
class Live:
    served: Served
    worker_port: int

    def api_page(self) -> str:
        return get_metrics(self.served)

    def worker_page(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.worker_port}/metrics", timeout=10).read().decode()

    def targets(self) -> list[str]:
        return [f"127.0.0.1:{self.served.port}", f"127.0.0.1:{self.worker_port}"]


def workload(served: Served, tag: str) -> None:
    """A few requests sharing a prefix (prefix hits), a chat one and a streamed one: every
    request histogram observes something."""
    (model,) = [m["id"] for m in json_get(served, "/v1/models")["data"]]
    for i in range(4):
        status, body = post(served, "/v1/completions", {"model": model, "prompt": f"{PROMPT} {tag} {i}", "max_tokens": 8})
        assert status == 200, body
    status, body = post(served, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": tag}], "max_tokens": 4})
    assert status == 200, body
    req = urllib.request.Request(served.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
                                 data=f'{{"model": "{model}", "prompt": "{tag}", "max_tokens": 4, "stream": true}}'.encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and b"[DONE]" in r.read()


def json_get(served: Served, path: str) -> dict:
    with urllib.request.urlopen(served.base_url + path, timeout=10) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    worker_port = free_port()
    args = ("--max-model-len", "1024", "--kv-cache-metrics", "--worker-http-port", str(worker_port))
    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("dashboards-serve"), *args) as served:
        workload(served, "first")
        yield Live(served, worker_port)


def test_the_shared_dashboard_and_the_rules_use_only_what_both_engines_expose(live):
    dash = grafana_dashboard(SHARED_DASHBOARD)
    exprs = dashboard_exprs(dash) + rule_exprs(RULES)
    problems = []
    # NOTE: kvpool's API page alone: a vLLM operator scrapes the API server, nothing else.
    for engine, page in (("vLLM 0.32 (saved page)", VLLM_PAGE.read_text()), ("kvpool serve", live.api_page())):
        problems += [f"{engine}: {p}" for p in check_exprs(exprs, page) + check_variables(dash, page) + filter_problems(dash, page)]
    assert problems == [], "\n".join(problems)


def test_the_internals_dashboard_finds_its_metrics_on_kvpools_pages(live):
    dash = grafana_dashboard(INTERNALS_DASHBOARD)
    # NOTE: the API's page and the worker's: two scrape targets, one text for the check.
    page = live.api_page() + live.worker_page()
    problems = check_exprs(dashboard_exprs(dash), page) + check_variables(dash, page) + filter_problems(dash, page)
    assert problems == [], "\n".join(problems)


def wait_until(what: str, ready, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what} not within {timeout} s:\n{log()}"
        time.sleep(0.5)


def test_every_expression_returns_series_from_a_live_kvpool(live, prometheus_server):
    prom = prometheus_server(live.targets(), rule_files=[RULES], job="kvpool-serve")
    # NOTE: Prometheus's first sample comes some seconds after start.
    wait_until("both targets up", lambda: len(prom.query("up == 1")) == 2, 40, prom.log_tail)
    workload(live.served, "second")
    finished = metric(live.api_page(), "vllm:request_success_total")
    wait_until("the workload scraped", lambda: prom.query(f"sum(vllm:request_success_total) >= {finished}") != [], 30, prom.log_tail)

    def empty_exprs() -> list[str]:
        empty = []
        for name in (SHARED_DASHBOARD, INTERNALS_DASHBOARD):
            dash = grafana_dashboard(name)
            empty += [f"{name}: {e}" for e in dashboard_exprs(dash) if prom.query(grafana_query(e)) == []]
            for var, m, label in dashboard_variables(dash):
                if not any(label in r["metric"] for r in prom.query(m)):
                    empty.append(f"{name}: variable {var}: label_values({m}, {label})")
        # An alert returns series only while it fires: each comparison made a bool one.
        return empty + [f"rules.yml: {e}" for e in rule_exprs(RULES) if prom.query(as_series_query(e)) == []]

    # NOTE: the two targets are scraped independently: the API's page can show the
    # workload while the worker's has one sample in the rate window (rate() is then
    # empty), so the check is retried until the next scrapes, bounded.
    deadline = time.monotonic() + 20
    while (empty := empty_exprs()) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert empty == [], "\n".join(empty)

    # Every rule evaluated at least once, none with an error.
    wait_until("every rule evaluated", lambda: all(r["health"] != "unknown" for r in prom.rules()), 30, prom.log_tail)
    rules = prom.rules()
    assert len(rules) == len(rule_exprs(RULES))
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in rules if r["health"] != "ok"] == []
