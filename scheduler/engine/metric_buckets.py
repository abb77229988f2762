"""vLLM 0.32's histogram bucket families (vllm/v1/metrics/buckets.py), the scheduler's copy.

Each vllm:* histogram of the scheduler takes its bounds from one of these, as vLLM's
PrometheusStatLogger does (no --custom-histogram-buckets here).
"""

from __future__ import annotations

# e2e, queue, inference, prefill and decode times of a request.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
    2560.0,
)  # fmt: skip
# Inter-token latency, and a request's mean time per output token.
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's ``request_tokens`` family: build_1_2_5_buckets(max_model_len),
    1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    return tuple(m * 10**e for e in range(len(str(max_model_len))) for m in (1, 2, 5) if m * 10**e <= max_model_len)
