"""A Prometheus collector's counters read from running totals at each scrape, every one
with the worker's labels (and, by reason, one more): the base of the external tier's and
P/D disaggregation's collectors."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector


class LabelledCounters(Collector):
    """Counter families labelled ``names`` = ``values``."""

    def __init__(self, names: list[str], values: list[str]):
        self.names = names
        self.values = values

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=self.names)
        family.add_metric(self.values, value)
        return family

    def _by_reason(self, name: str, doc: str, counts: dict[str, int]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=[*self.names, "reason"])
        for reason, n in sorted(counts.items()):
            family.add_metric([*self.values, reason], n)
        return family
