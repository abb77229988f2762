"""A small PromQL reader for the deploy/ tests: the metric names an expression uses, each
with the functions around it (so that rate() can be checked to get a counter and
histogram_quantile() a histogram's buckets); the type a name has on an exposition page;
an alert expression made to return its series whatever their values; Grafana's
variables filled in for a query to Prometheus's HTTP API."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

COUNTER_FUNCTIONS = {"rate", "irate", "increase"}
RANGE_FUNCTIONS = COUNTER_FUNCTIONS | {"deriv", "delta", "idelta", "predict_linear"} | {
    f"{a}_over_time" for a in ("avg", "min", "max", "sum", "count", "last", "quantile", "stddev")
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}
# Series Prometheus makes itself, and the labels it adds to every scraped series: on no
# exposition page.
PROMETHEUS_OWN = {"up"}
TARGET_LABELS = {"instance", "job"}


def _strip(expr: str) -> str:
    """The expression without strings, label matchers, ranges and grouping clauses."""
    e = re.sub(r'"[^"]*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    return re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)


def metric_uses(expr: str) -> list[tuple[str, tuple[str, ...]]]:
    """(metric name, the functions and aggregations around it, outermost first) for each
    metric an expression names."""
    out, stack = [], []
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?|\(|\)", _strip(expr)):
        name, call = m.group(1), m.group(2)
        if name and call:
            stack.append(name)
        elif name and name not in KEYWORDS:
            out.append((name, tuple(stack)))
        elif m.group(0) == "(":
            stack.append("")
        elif m.group(0) == ")":
            stack.pop()
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (inside {...} or by (...)) or durations."""
    return {name for name, _ in metric_uses(expr)}


def sample_types(text: str) -> dict[str, tuple[str, str]]:
    """Each sample name on an exposition page: (its family's type, the name's suffix)."""
    return {s.name: (f.type, s.name.removeprefix(f.name)) for f in text_string_to_metric_families(text) for s in f.samples}


def sample_labels(text: str) -> dict[str, set[str]]:
    """Each sample name on an exposition page: the label names its samples carry."""
    out: dict[str, set[str]] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def matcher_labels(expr: str) -> list[tuple[str, set[str]]]:
    """(metric, the label names its {...} matchers test) for each selector with matchers."""
    e = re.sub(r'"[^"]*"', '""', expr)
    return [(m.group(1), set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(2))))
            for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", e)]


def use_problem(name: str, functions: tuple[str, ...], types: dict[str, tuple[str, str]]) -> str | None:
    """Why one use of a metric is wrong on a page (missing, or the wrong type for the
    function around it); None when it is right."""
    if name not in types:
        return f"{name}: not on the page"
    kind, suffix = types[name]
    ranged = next((f for f in reversed(functions) if f in RANGE_FUNCTIONS), None)
    if "histogram_quantile" in functions and (kind, suffix) != ("histogram", "_bucket"):
        return f"{name}: histogram_quantile() over a {kind}'s {suffix or 'value'}, not a histogram's _bucket"
    if ranged in COUNTER_FUNCTIONS:
        if (kind, suffix) == ("counter", "_total") or (kind in ("histogram", "summary") and suffix in ("_bucket", "_sum", "_count")):
            return None
        return f"{name}: {ranged}() of a {kind}, not a counter"
    if kind != "gauge":
        return f"{name}: used as a gauge ({ranged or 'no range function'}) but it is a {kind}"
    return None


def as_series_query(expr: str) -> str:
    """An alert expression that returns its series whatever their values: each comparison
    with a number made a `bool` one (1 or 0 instead of a filter)."""
    return re.sub(r"(==|!=|>=|<=|>|<)\s*(?=-?[\d.])", r"\1 bool ", expr)


def grafana_query(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard target with its variables filled: every template variable matches all
    (".*", what the dashboards' "All" sends), $__rate_interval and $__interval a range."""
    ranges = {"__rate_interval": rate_interval, "__interval": rate_interval}
    return re.sub(r"\$\{?(\w+)\}?", lambda m: ranges.get(m.group(1), ".*"), expr)
