"""bench/pd_bench.py's figures and trace, and bench/pd_sim_check.py's replay of it, on
hand-made requests (the live runs themselves are the benchmark's, not the suite's)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from bench.pd_bench import figures, write_trace
from bench.pd_sim_check import calibrate, simulate


def requests() -> list[dict]:
    # Two decode streams (gaps of 10 ms, one stall of 500 ms) and one long prompt.
    return [
        {"kind": "decode", "sent_s": 0.0, "prompt_tokens": 9, "output_tokens": 4, "ttft": 0.05, "gaps": [0.01, 0.01, 0.5]},
        {"kind": "decode", "sent_s": 0.1, "prompt_tokens": 9, "output_tokens": 4, "ttft": 0.07, "gaps": [0.01, 0.01, 0.01]},
        {"kind": "long", "sent_s": 0.2, "prompt_tokens": 1200, "output_tokens": 2, "ttft": 0.9, "gaps": [0.02]},
    ]


def test_figures_split_the_decode_streams_from_the_long_prompts():
    f = figures(requests(), seconds=2.0)
    assert (f["decode_requests"], f["long_requests"]) == (2, 1)
    assert f["decode_itl_p50_ms"] == 10.0 and f["decode_itl_max_ms"] == 500.0 and f["decode_stalls_over_100ms"] == 1
    assert f["long_ttft_p50_ms"] == 900.0 and f["long_prompt_tokens"] == 1200
    # TPOT: each request's mean gap (10 ms, and 520 / 3 ms); of two, the p50 is the upper one.
    assert f["decode_tpot_p50_ms"] == f["decode_tpot_p99_ms"] == round(1000 * 0.52 / 3, 2)
    assert f["all_ttft_p99_ms"] == 900.0 and f["output_tok_s"] == (4 + 4 + 2) / 2.0


def test_the_trace_replays_in_the_simulator(tmp_path):
    trace = tmp_path / "run.jsonl"
    write_trace(requests(), trace)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [(r["timestamp"], r["input_length"], r["output_length"]) for r in lines] == [(0, 9, 4), (100, 9, 4), (200, 1200, 2)]
    # A hash id per 512 tokens, none shared: 1, 1 and 3.
    assert [r["hash_ids"] for r in lines] == [[0], [1], [2, 3, 4]]
    live = figures(requests(), 2.0)
    overhead, per_token = calibrate(live, decoders=2)
    assert per_token == (900.0 - 10.0) / 1200 and overhead == 10.0 - 2 * per_token
    a = SimpleNamespace(num_blocks=256, kv_bytes_per_token=1000, transfer_gbps=1.0, transfer_latency_ms=1.0)
    one, pd = simulate(trace, "one", overhead, per_token, a), simulate(trace, "1p1d", overhead, per_token, a)
    # The long prompt's prefill alone is 1200 tokens at the calibrated cost: both layouts' worst TTFT is at least that.
    assert one["ttft_p99_ms"] >= 1200 * per_token and pd["ttft_p99_ms"] >= 1200 * per_token
    # 1P1D adds the read of its 75 blocks (1.2 MB at 1 GB/s, 1 ms latency) and a step on the decode engine.
    assert pd["ttft_p99_ms"] > one["ttft_p99_ms"]
