"""`--plot`: the scheduler's KV-cache state over the run, one PNG.

Four panels sharing the time axis (seconds from the first scrape): KV cache usage,
free blocks that still hold a cached hash (what usage hides), running and waiting
requests, and the prefix-cache hit rate (per scrape interval and cumulative).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from loadgen.metrics_scraper import MetricsSample  # noqa: E402


def _xy(series: Sequence[MetricsSample], name: str, t0: float) -> tuple[list[float], list[float]]:
    pts = [(s.t - t0, v) for s in series if (v := getattr(s, name)) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def hit_rates(
    series: Sequence[MetricsSample], t0: float
) -> tuple[list[float], list[float], list[float]]:
    """(t, interval hit rate, cumulative hit rate since the first sample); intervals
    without queries are skipped."""
    pts = [
        s for s in series if s.prefix_cache_queries is not None and s.prefix_cache_hits is not None
    ]
    ts, interval, cumulative = [], [], []
    for prev, cur in zip(pts, pts[1:], strict=False):
        dq = cur.prefix_cache_queries - prev.prefix_cache_queries
        if dq <= 0:
            continue
        ts.append(cur.t - t0)
        interval.append((cur.prefix_cache_hits - prev.prefix_cache_hits) / dq)
        total_q = cur.prefix_cache_queries - pts[0].prefix_cache_queries
        cumulative.append((cur.prefix_cache_hits - pts[0].prefix_cache_hits) / total_q)
    return ts, interval, cumulative


def plot_timeseries(
    series: Sequence[MetricsSample], path: str | Path, title: str = "kvpool"
) -> None:
    """Write the PNG; an empty series gives a figure that says so."""
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    t0 = series[0].t if series else 0.0
    ax = axes[0]
    ax.plot(*_xy(series, "kv_cache_usage", t0), color="tab:blue")
    ax.set_ylabel("KV cache usage")
    ax.set_ylim(0, 1.05)
    ax = axes[1]
    ax.plot(*_xy(series, "free_cached_blocks", t0), color="tab:green", label="free, still cached")
    ax.set_ylabel("blocks")
    ax.legend(loc="upper left")
    ax = axes[2]
    ax.plot(*_xy(series, "num_running", t0), label="running")
    ax.plot(*_xy(series, "num_waiting", t0), label="waiting")
    ax.set_ylabel("requests")
    ax.legend(loc="upper left")
    ax = axes[3]
    ts, interval, cumulative = hit_rates(series, t0)
    ax.plot(ts, interval, ".", color="tab:orange", label="per interval")
    ax.plot(ts, cumulative, color="tab:red", label="cumulative")
    ax.set_ylabel("prefix cache hit rate")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right")
    ax.set_xlabel("time (s)")
    if not series:
        axes[0].text(0.5, 0.5, "no /metrics samples", transform=axes[0].transAxes, ha="center")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
