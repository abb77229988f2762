"""`python -m scheduler --kv-cache-metrics`: vLLM's KV residency histograms and
kvpool's usage gauges from a real process (fake worker, real sockets)."""

from __future__ import annotations

import pytest
from kvtest.scheduler_harness import NUM_BLOCKS, Setup, metric, prompt_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

RESIDENCY = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_reuse_gap_seconds")


def test_residency_histograms_observe_reused_blocks_and_gauges_report_the_peak():
    s = Setup("--kv-cache-metrics", "--max-model-len", "2048")
    try:
        before = s.wait_idle()
        for name in RESIDENCY:
            assert metric(before, f"{name}_count") == 0
        assert metric(before, "kvpool_peak_kv_cache_usage_perc") == 0
        # Four 400-token prompts, one after another: 25 blocks each of 63, so the
        # third and fourth reuse the first ones' blocks.
        for i in range(4):
            s.client.generate(f"r{i}", prompt_of(i, 400), 2)
        after = s.wait_idle()
        evictions = metric(after, "kvpool_evictions_total")
        assert evictions > 0
        # Every reused block ends a tenancy; the hashed ones are also evictions.
        assert metric(after, "vllm:kv_block_lifetime_seconds_count") >= evictions
        assert metric(after, "vllm:kv_block_idle_before_evict_seconds_count") == metric(after, "vllm:kv_block_lifetime_seconds_count")
        assert metric(after, "vllm:kv_block_lifetime_seconds_bucket", 'le="1800.0"') == metric(after, "vllm:kv_block_lifetime_seconds_count")
        # Idle now, but the peak of one 401-token request (26 blocks) is kept.
        assert metric(after, "vllm:kv_cache_usage_perc") == 0
        assert metric(after, "kvpool_peak_kv_cache_usage_perc") == pytest.approx(26 / (NUM_BLOCKS - 1))
        assert metric(after, "kvpool_kv_cache_token_usage_perc") == 0
        assert s.worker.errors == []
    finally:
        s.close()


def test_without_the_flag_there_are_no_residency_histograms():
    s = Setup()
    try:
        values = s.wait_idle()
        assert not any(name.startswith(RESIDENCY) for name in values)
        assert metric(values, "kvpool_kv_cache_token_usage_perc") == 0
    finally:
        s.close()


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5"])
def test_a_sample_outside_zero_to_one_is_refused_naming_the_flag(value, capsys):
    from scheduler.engine.args import config_from_args

    with pytest.raises(SystemExit) as e:
        config_from_args(["--kv-cache-metrics", "--kv-cache-metrics-sample", value])
    assert e.value.code == 2 and "--kv-cache-metrics-sample must be in (0, 1]" in capsys.readouterr().err


def test_the_flags_reach_the_config():
    from scheduler.engine.args import config_from_args

    c = config_from_args(["--kv-cache-metrics", "--kv-cache-metrics-sample", "0.25"])
    assert c.kv_cache_metrics is True and c.kv_cache_metrics_sample == 0.25
    d = config_from_args([])
    assert d.kv_cache_metrics is False and d.kv_cache_metrics_sample == 1.0
