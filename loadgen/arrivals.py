"""When each request is sent: a seeded Poisson / gamma arrival schedule, as `vllm bench serve`.

Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean 1/rate:
burstiness 1.0 is a Poisson process, below 1 is burstier, above 1 more regular.
A rate of inf sends everything at once. Trace replay brings its own offsets.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(
    num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> np.ndarray:
    """Send offsets in seconds from the start of the run, non-decreasing, first at 0."""
    if num_requests <= 0:
        return np.zeros(0)
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)  # scale, so that the mean gap is 1/rate
    gaps = rng.gamma(shape=burstiness, scale=theta, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
