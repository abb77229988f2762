"""Reads the scheduler's Prometheus /metrics before, during and after a run.

`parse_metrics_text` turns one exposition into a `MetricsSample` (values summed over
label sets; None where the scheduler does not export a metric). `MetricsScraper` polls
in a background task and keeps the time series in memory for the report and the plot.
A scrape that fails is counted and skipped: the run never depends on /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, fields

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

# MetricsSample field -> sample name in the exposition. Counters are matched with and
# without `_total` (the parser's family names drop it; the samples keep it).
SAMPLE_NAMES = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    # The scheduler's own peak since its start, taken at every allocation.
    "peak_kv_cache_usage": "kvpool_peak_kv_cache_usage_perc",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "num_running": "vllm:num_requests_running",
    "num_waiting": "vllm:num_requests_waiting",
    "num_preemptions": "vllm:num_preemptions_total",
    "free_cached_blocks": "kvpool_free_cached_blocks",
    "num_gpu_blocks": "kvpool_num_gpu_blocks",
    "evictions": "kvpool_evictions_total",
}


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One scrape; `t` in seconds on the run's clock (time.perf_counter)."""

    t: float
    kv_cache_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    num_running: float | None = None
    num_waiting: float | None = None
    num_preemptions: float | None = None
    free_cached_blocks: float | None = None
    num_gpu_blocks: float | None = None
    evictions: float | None = None
    # NOTE: last, so that positional construction keeps its meaning.
    peak_kv_cache_usage: float | None = None


def _lookup_names() -> dict[str, str]:
    out = {}
    for field_name, name in SAMPLE_NAMES.items():
        out[name] = field_name
        if name.endswith("_total"):
            out[name.removesuffix("_total")] = field_name
    return out


_BY_SAMPLE_NAME = _lookup_names()


def parse_metrics_text(text: str, t: float = 0.0) -> MetricsSample:
    """Sum each known metric over its label sets; raises ValueError on unparsable text."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field_name = _BY_SAMPLE_NAME.get(sample.name)
                if field_name is not None:
                    values[field_name] = values.get(field_name, 0.0) + sample.value
    except (ValueError, IndexError, KeyError, TypeError) as e:
        # NOTE: the parser raises several types on bad input; callers see one.
        raise ValueError(f"unparsable metrics text: {e}") from None
    return MetricsSample(t=t, **values)


def delta(before: MetricsSample | None, after: MetricsSample | None, name: str) -> float | None:
    """after.name − before.name, or None if either side is missing."""
    if before is None or after is None:
        return None
    a, b = getattr(after, name), getattr(before, name)
    return None if a is None or b is None else a - b


METRIC_FIELDS = tuple(f.name for f in fields(MetricsSample) if f.name != "t")


class MetricsScraper:
    """Scrape `url` once (`scrape`) or every `interval` seconds in the background."""

    def __init__(self, url: str, interval: float = 0.5, timeout: float = 2.0):
        self.url = url
        self.interval = interval
        self.series: list[MetricsSample] = []
        self.num_errors = 0
        self.last_error: str | None = None
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task | None = None

    async def scrape(self) -> MetricsSample | None:
        """One scrape, appended to the series; None (and counted) if it failed."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        try:
            async with self._session.get(self.url) as resp:
                resp.raise_for_status()
                text = await resp.text()
            sample = parse_metrics_text(text, time.perf_counter())
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            self.num_errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.debug("scrape of %s failed: %s", self.url, self.last_error)
            return None
        self.series.append(sample)
        return sample

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.scrape()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._poll(), name="loadgen-metrics")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def close(self) -> None:
        await self.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None
