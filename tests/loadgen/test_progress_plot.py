"""The progress line and the plot."""

from __future__ import annotations

import io

from loadgen.metrics_scraper import MetricsSample
from loadgen.plot import hit_rates, plot_timeseries
from loadgen.progress import Progress


def test_progress_only_when_enabled():
    buf = io.StringIO()  # not a terminal: silent by default
    p = Progress(3, stream=buf)
    p.update(True)
    p.close()
    assert buf.getvalue() == ""
    buf = io.StringIO()
    p = Progress(2, stream=buf, enabled=True, min_interval=0)
    p.update(True)
    p.update(False)
    p.close()
    out = buf.getvalue()
    assert out.startswith("\r[") and "2/2 done, 1 failed" in out and out.endswith("\n")


def test_hit_rates_and_plot(tmp_path):
    series = [
        MetricsSample(10.0, 0.1, 0, 0, 1, 0, 0, 5),
        MetricsSample(10.5, 0.5, 100, 50, 2, 3, 0, 4),
        MetricsSample(11.0, 0.9, 100, 50, 2, 3, 1, 3),  # no new queries: skipped
        MetricsSample(11.5, 0.7, 300, 50, 1, 0, 1, 8),
    ]
    ts, interval, cumulative = hit_rates(series, 10.0)
    assert ts == [0.5, 1.5] and interval == [0.5, 0.0] and cumulative == [0.5, 50 / 300]
    path = tmp_path / "p.png"
    plot_timeseries(series, path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    plot_timeseries([], tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 0
