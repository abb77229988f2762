"""The arrival schedule: inf rate, seeded Poisson and gamma gaps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.arrivals import arrival_offsets


def test_inf_rate_sends_at_once():
    assert np.array_equal(arrival_offsets(5, math.inf), np.zeros(5))
    assert len(arrival_offsets(0, 3.0)) == 0


def test_poisson_seeded_mean_and_cv():
    a = arrival_offsets(20001, 10.0, 1.0, seed=42)
    assert np.array_equal(a, arrival_offsets(20001, 10.0, 1.0, seed=42))
    assert not np.array_equal(a, arrival_offsets(20001, 10.0, 1.0, seed=43))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


def test_gamma_burstiness_changes_cv_not_mean():
    for shape in (0.25, 4.0):
        gaps = np.diff(arrival_offsets(20001, 5.0, shape, seed=1))
        assert gaps.mean() == pytest.approx(0.2, rel=0.05)
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(shape), rel=0.06)


def test_matches_numpy_gamma_draws():
    rng = np.random.default_rng(9)
    gaps = rng.gamma(shape=2.0, scale=1 / (4.0 * 2.0), size=4)
    assert np.allclose(arrival_offsets(5, 4.0, 2.0, seed=9), np.concatenate([[0], np.cumsum(gaps)]))


def test_rejects_bad_parameters():
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError):
        arrival_offsets(3, 1.0, burstiness=0.0)
