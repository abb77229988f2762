"""vLLM 0.32's histogram bucket families (vllm/v1/metrics/buckets.py), the scheduler's copy.

Each vllm:* histogram of the scheduler takes its bounds from one of these, as vLLM's
PrometheusStatLogger does; ``--custom-histogram-buckets`` (vLLM's JSON mapping, family
-> bounds, checked as vLLM's ObservabilityConfig) replaces a family's bounds in every
histogram of it. kvpool refuses the two families the frontend's histograms also draw
on (vllm:request_params_n; vllm:request_prompt_tokens and the other request_tokens
ones): the frontend keeps vLLM's defaults, and one family must not differ per process.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from itertools import pairwise

from scheduler.core.block_residency import RESIDENCY_BUCKETS

# vLLM 0.32's BucketFamilyKey.
FAMILIES = ("request_latency", "time_to_first_token", "inter_token_latency", "iteration_tokens", "request_params_n",
            "request_num_preemptions", "request_tokens", "kv_cache_residency")
FRONTEND_FAMILIES = ("request_params_n", "request_tokens")

# e2e, queue, inference, prefill and decode times of a request.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
    2560.0,
)
# Inter-token latency, and a request's mean time per output token.
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``request_tokens`` family: build_1_2_5_buckets(max_model_len),
    1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    return tuple(m * 10**e for e in range(len(str(max_model_len))) for m in (1, 2, 5) if m * 10**e <= max_model_len)


def custom_histogram_buckets(text: str) -> dict[str, tuple[float, ...]]:
    """``--custom-histogram-buckets JSON``: vLLM's checks and wording (the bounds as
    floats, as pydantic makes them first); then kvpool's refusal of the frontend's families.
    Raises argparse.ArgumentTypeError naming the problem (argparse: exit 2)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("custom_histogram_buckets: must be a JSON object of family -> list of bounds")
    for family, bounds in value.items():
        if family not in FAMILIES:
            raise argparse.ArgumentTypeError(
                f"custom_histogram_buckets: unknown bucket family {family!r}; known families: {sorted(FAMILIES)}"
            )
        for bound in bounds if isinstance(bounds, list) else ():
            if isinstance(bound, bool):
                raise argparse.ArgumentTypeError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be a number, not a boolean")
        if not isinstance(bounds, list) or not all(isinstance(b, int | float) for b in bounds):
            raise argparse.ArgumentTypeError(f"custom_histogram_buckets[{family!r}]: must be a list of numbers, got {bounds!r}")
        value[family] = bounds = [float(b) for b in bounds]  # NOTE: as pydantic's list[float], before vLLM's checks
        if not bounds:
            raise argparse.ArgumentTypeError(f"custom_histogram_buckets[{family!r}]: bucket list must not be empty")
        for bound in bounds:
            if not math.isfinite(bound) or bound <= 0:
                raise argparse.ArgumentTypeError(f"custom_histogram_buckets[{family!r}]: bound {bound!r} must be finite and greater than 0")
        if any(a >= b for a, b in pairwise(bounds)):
            raise argparse.ArgumentTypeError(f"custom_histogram_buckets[{family!r}]: bounds {bounds} must be strictly increasing")
    for family in FRONTEND_FAMILIES:
        if family in value:
            raise argparse.ArgumentTypeError(
                f"custom_histogram_buckets[{family!r}]: kvpool does not support overriding this family yet: "
                "the frontend's histograms draw on it and keep vLLM's defaults"
            )
    return {family: tuple(bounds) for family, bounds in value.items()}


def histogram_buckets(family: str, overrides: Mapping[str, tuple[float, ...]] | None, max_model_len: int = 0) -> tuple:
    """The bounds of ``family``'s histograms: the override if given, else vLLM's defaults
    (``request_tokens``: up to ``max_model_len``)."""
    if overrides and family in overrides:
        return overrides[family]
    if family == "request_tokens":
        return request_tokens_buckets(max_model_len)
    return _DEFAULTS[family]


_DEFAULTS = {
    "request_latency": REQUEST_LATENCY_BUCKETS, "time_to_first_token": TIME_TO_FIRST_TOKEN_BUCKETS,
    "inter_token_latency": INTER_TOKEN_LATENCY_BUCKETS, "iteration_tokens": ITERATION_TOKENS_BUCKETS,
    "request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS, "kv_cache_residency": RESIDENCY_BUCKETS,
}
