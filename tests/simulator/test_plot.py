"""The simulator's plot: a y-axis that fits the data, coinciding policies named."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.plot import legend_labels, plot_hit_rates, series, y_limits
from simulator.result import SimResult


def result(num_blocks: int, policy: str, hit_rate: float) -> SimResult:
    return SimResult(num_blocks, policy, hit_rate, 100, round(hit_rate * 100), 0.0, 0, 0, *([0] * 5), 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0)


def test_y_limits_fit_small_hit_rates_instead_of_zero_to_one():
    lo, hi = y_limits([0.037, 0.040, 0.082])
    # The data's span is 0.045; 10 % of it as a margin on each side.
    assert lo == pytest.approx(0.0325) and hi == pytest.approx(0.0865)


def test_y_limits_stay_within_zero_and_one_and_widen_equal_values():
    assert y_limits([0.0, 0.001]) == (0.0, pytest.approx(0.024))
    assert y_limits([1.0]) == (pytest.approx(0.976), 1.0)
    lo, hi = y_limits([0.5, 0.5])
    assert lo < 0.5 < hi and hi - lo == pytest.approx(0.024)
    assert y_limits([]) == (0.0, 1.0)


def test_coinciding_policies_are_named_in_the_legend():
    results = [result(100, "vllm", 0.1), result(100, "tail", 0.1), result(100, "forward", 0.2),
               result(200, "vllm", 0.3), result(200, "tail", 0.3), result(200, "forward", 0.3)]
    lines = series(results)
    assert lines == {"vllm": [(100, 0.1), (200, 0.3)], "tail": [(100, 0.1), (200, 0.3)], "forward": [(100, 0.2), (200, 0.3)]}
    assert legend_labels(lines) == {"vllm": "vllm", "tail": "tail (= vllm)", "forward": "forward"}


def test_plot_writes_a_png(tmp_path: Path):
    out = tmp_path / "p.png"
    plot_hit_rates([result(100, "vllm", 0.05), result(200, "vllm", 0.06), result(100, "tail", 0.05)], out, "t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
