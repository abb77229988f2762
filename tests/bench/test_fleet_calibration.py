"""The fleet bench's simulator timing from live runs (bench/fleet_bench.py `Calibration`):
the step model from the engines' inter-token latency and prefill time over the uncached
tokens, the way there and back from what round_robin's clients waited beyond the
engines, and kv_aware's time to decide from what its clients waited beyond that."""

from __future__ import annotations

import pytest

from bench.fleet_bench import METRICS, Calibration, Timing


def timing(requests: int, client_s: float, **sums: float) -> Timing:
    values = dict.fromkeys(METRICS, 0.0) | {name.replace("__", ":"): v for name, v in sums.items()}
    return Timing(requests, client_s, tuple(values[m] for m in METRICS))


def engines(**extra: float) -> dict[str, float]:
    # 100 requests: 20,000 prompt tokens looked up, 4,000 hits (160 uncached a request);
    # 40 ms in the engine, one 12 ms decode step, 20 ms from scheduled to first token.
    return {"vllm__prefix_cache_hits_total": 4000, "vllm__prefix_cache_queries_total": 20000,
            "vllm__e2e_request_latency_seconds_sum": 4.0, "vllm__e2e_request_latency_seconds_count": 100,
            "vllm__inter_token_latency_seconds_sum": 1.2, "vllm__inter_token_latency_seconds_count": 100,
            "vllm__request_prefill_time_seconds_sum": 2.0, "vllm__request_prefill_time_seconds_count": 100} | extra


def test_the_step_model_and_the_paths_come_from_the_live_timing():
    rr = timing(100, 5.0, **engines())  # clients waited 50 ms: 10 outside the engines
    kv = timing(100, 5.6, **engines())  # 56 ms: 6 more to decide
    cal = Calibration.of({"round_robin": rr, "cache_aware": rr, "kv_aware": kv})
    assert cal.step_overhead_ms == pytest.approx(12.0)
    assert cal.ms_per_token == pytest.approx((20.0 - 12.0) / 160)
    assert cal.way_ms == pytest.approx(5.0)
    assert cal.decide_ms == pytest.approx({"round_robin": 0.0, "cache_aware": 0.0, "kv_aware": 6.0})


def test_runs_add_up_before_the_means_are_taken():
    one = timing(100, 5.0, **engines())
    two = one.add(timing(100, 7.0, **engines(vllm__e2e_request_latency_seconds_sum=6.0)))
    assert two.requests == 200
    assert two.outside_ms == pytest.approx((12.0 / 200 - 10.0 / 200) * 1e3)
