"""Report statistics against hand-computed numbers."""

from __future__ import annotations

import json

import pytest

from loadgen.metrics_scraper import MetricsSample
from loadgen.report import format_report, latency_stats, summarize, write_result_json
from loadgen.request_result import RequestResult


def _ok(i, ttft, latency, itl, n_tokens, prompt_len=10):
    return RequestResult(
        i,
        f"r-{i}",
        prompt_len,
        success=True,
        finish_reason="length",
        ttft_s=ttft,
        latency_s=latency,
        itl_s=list(itl),
        token_ids=list(range(2, 2 + n_tokens)),
    )


def test_latency_stats_hand_computed():
    s = latency_stats([0.001, 0.002, 0.003, 0.010])
    assert s["mean"] == pytest.approx(4.0)
    assert s["median"] == pytest.approx(2.5)
    # p99 by linear interpolation: rank 0.99*3 = 2.97 -> 3 + 0.97*(10-3) = 9.79
    assert s["p99"] == pytest.approx(9.79)
    assert latency_stats([]) == {"mean": None, "median": None, "p99": None}


def test_summarize_hand_computed():
    results = [
        _ok(0, ttft=0.1, latency=0.5, itl=[0.2, 0.2], n_tokens=3),  # tpot (0.5-0.1)/2 = 0.2
        _ok(1, ttft=0.3, latency=1.3, itl=[0.5, 0.5], n_tokens=3),  # tpot 0.5
        _ok(2, ttft=0.2, latency=0.2, itl=[], n_tokens=1),  # no tpot
        RequestResult(3, "r-3", 10, error="rejected by the scheduler: too long"),
    ]
    before = MetricsSample(
        0.0, kv_cache_usage=0.0, prefix_cache_queries=100, prefix_cache_hits=10, num_preemptions=2
    )
    mid = MetricsSample(1.0, kv_cache_usage=0.9)
    after = MetricsSample(
        2.0, kv_cache_usage=0.3, prefix_cache_queries=300, prefix_cache_hits=90, num_preemptions=5
    )
    s = summarize(results, 2.0, before, after, [before, mid, after])
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["duration_s"] == 2.0
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(7 / 2.0)
    assert s["total_input_tokens"] == 30
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["median"] == pytest.approx(200.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(350.0)
    assert s["itl_ms"]["mean"] == pytest.approx(350.0)
    assert s["itl_ms"]["median"] == pytest.approx(350.0)
    assert s["e2el_ms"]["mean"] == pytest.approx(2000 / 3)
    assert s["e2el_ms"]["median"] == pytest.approx(500.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(80 / 200)
    assert s["num_preemptions"] == 3
    assert s["peak_kv_cache_usage"] == pytest.approx(0.9)
    assert s["mean_kv_cache_usage"] == pytest.approx(0.4)
    assert s["errors"] == {"rejected by the scheduler: too long": 1}
    text = format_report(s)
    assert "Successful requests:" in text and "40.00%" in text and "Mean TTFT (ms):" in text


def test_summarize_without_metrics_or_successes():
    s = summarize([RequestResult(0, "r-0", 5, error="x")], 1.0)
    assert s["completed"] == 0 and s["failed"] == 1
    assert s["prefix_cache_hit_rate"] is None and s["num_preemptions"] is None
    assert s["peak_kv_cache_usage"] is None and s["ttft_ms"]["mean"] is None
    assert "n/a" in format_report(s)


def test_result_json_keys_and_outputs(tmp_path):
    results = [_ok(1, 0.1, 0.2, [0.1], 2), _ok(0, 0.1, 0.2, [0.1], 2)]
    s = summarize(results, 1.0)
    path = tmp_path / "r.json"
    write_result_json(path, s, results)
    data = json.loads(path.read_text())
    for key in (
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "output_throughput",
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
        "e2el_ms",
        "prefix_cache_hit_rate",
        "num_preemptions",
        "peak_kv_cache_usage",
        "mean_kv_cache_usage",
    ):
        assert key in data
    assert [o["index"] for o in data["outputs"]] == [0, 1]
    assert data["outputs"][0] == {"index": 0, "request_id": "r-0", "token_ids": [2, 3]}
    write_result_json(path, s)
    assert "outputs" not in json.loads(path.read_text())


def _failed(i: int, error: str) -> RequestResult:
    return RequestResult(i, f"r-{i}", 10, error=error)


def test_every_failure_is_accounted_for_beyond_the_listed_five():
    # 17 distinct rejections (the scheduler names each request's length): 5 listed, 12 counted.
    results = [_failed(i, f"rejected by the scheduler: prompt ({1000 + i} tokens) + max_tokens (8) = {1008 + i} "
                          f"is over max_model_len (1000)") for i in range(17)]
    results += [_failed(17, "no response from the scheduler for 5 s")]
    text = format_report(summarize(results, 1.0))
    lines = text.splitlines()
    assert sum(line.startswith("failed x1: ") for line in lines) == 5
    assert "... and 13 more failed requests with 13 other errors (all in --result-json)" in lines
    hint = next(line for line in lines if line.startswith("hint: "))
    assert hint.startswith("hint: 17 requests were refused as longer than") and "--max-input-len" in hint


def test_the_openai_servers_refusal_gets_the_hint_too():
    # vLLM's wording (kvpool serve's too), through --backend openai.
    err = ("HTTP 400: This model's maximum context length is 2048 tokens. However, your request has "
           "6909 input tokens. Please reduce the length of the input messages.")
    assert "hint: 1 requests were refused" in format_report(summarize([_failed(0, err)], 1.0))


def test_no_more_line_and_no_hint_when_all_are_listed_and_none_too_long():
    text = format_report(summarize([_failed(i, f"error {i}") for i in range(5)], 1.0))
    assert "more failed requests" not in text and "hint:" not in text


def test_the_report_names_its_workload_and_the_pool_it_met():
    after = MetricsSample(t=1.0, num_gpu_blocks=256.0)
    s = summarize([_ok(0, 0.1, 0.2, [0.1], 2)], 1.0, MetricsSample(t=0.0), after, [])
    s["workload"] = "shared-prefix: 1 requests (...)"
    text = format_report(s)
    assert "Workload: shared-prefix: 1 requests (...)" in text.splitlines()
    assert next(line for line in text.splitlines() if line.startswith("KV pool (blocks, /metrics):")).split()[-1] == "256"
    assert summarize([], 1.0)["num_gpu_blocks"] is None


def test_peak_usage_is_the_schedulers_own_when_it_rose_during_the_run():
    # The polls saw 0 % (between steps), but the scheduler's own peak rose to 75 %.
    before = MetricsSample(0.0, kv_cache_usage=0.0, peak_kv_cache_usage=0.1)
    after = MetricsSample(1.0, kv_cache_usage=0.0, peak_kv_cache_usage=0.75)
    s = summarize([_ok(0, 0.1, 0.2, [0.1], 2)], 1.0, before, after, [before, after])
    assert s["peak_kv_cache_usage"] == 0.75 and s["peak_kv_cache_usage_exact"] is True
    assert "75.00%" in format_report(s) and "polled" not in format_report(s)


def test_peak_usage_falls_back_to_the_polls_when_an_earlier_run_peaked_higher():
    before = MetricsSample(0.0, kv_cache_usage=0.0, peak_kv_cache_usage=0.9)
    mid = MetricsSample(0.5, kv_cache_usage=0.25)
    after = MetricsSample(1.0, kv_cache_usage=0.0, peak_kv_cache_usage=0.9)
    s = summarize([_ok(0, 0.1, 0.2, [0.1], 2)], 1.0, before, after, [before, mid, after])
    assert s["peak_kv_cache_usage"] == 0.25 and s["peak_kv_cache_usage_exact"] is False
    text = format_report(s)
    assert "25.00%" in text and "polled: the scheduler's own peak, 90.00%, is an earlier run's" in text


def test_peak_usage_without_the_gauge_is_the_polled_one():
    before, after = MetricsSample(0.0, kv_cache_usage=0.5), MetricsSample(1.0, kv_cache_usage=0.2)
    s = summarize([_ok(0, 0.1, 0.2, [0.1], 2)], 1.0, before, after, [before, after])
    assert s["peak_kv_cache_usage"] == 0.5 and s["peak_kv_cache_usage_exact"] is None


def test_cached_tokens_are_unknown_when_a_request_was_not_told():
    # prompt lengths 10 + 10; the server reported 4 cached tokens for one and nothing for the other
    told, untold = _ok(0, 0.1, 0.5, [0.2], 2), _ok(1, 0.1, 0.5, [0.2], 2)
    told.num_cached_tokens, untold.num_cached_tokens = 4, None
    assert summarize([told, untold], 1.0)["client_cached_token_frac"] is None
    untold.num_cached_tokens = 6
    assert summarize([told, untold], 1.0)["client_cached_token_frac"] == pytest.approx(10 / 20)
