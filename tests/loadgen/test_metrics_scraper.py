"""Parsing the scheduler's Prometheus text, and the background scraper."""

from __future__ import annotations

import asyncio

import pytest

from loadgen.metrics_scraper import MetricsScraper, delta, parse_metrics_text

TEXT = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:prefix_cache_queries Prefix cache queries.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7e9
# HELP vllm:prefix_cache_hits Prefix cache hits.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 300.0
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 100.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 3
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 4
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 4
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.5
# TYPE kvpool_free_cached_blocks gauge
kvpool_free_cached_blocks{engine="0",model_name="tiny"} 42
"""


def test_parse_sums_label_sets_and_ignores_others():
    s = parse_metrics_text(TEXT, t=3.0)
    assert s.t == 3.0
    assert s.kv_cache_usage == 0.25
    assert s.prefix_cache_queries == 1000.0  # _created is not the counter's value
    assert s.prefix_cache_hits == 400.0  # summed over engines
    assert s.num_waiting == 7
    assert s.free_cached_blocks == 42
    assert s.num_running is None and s.num_preemptions is None


def test_delta():
    a = parse_metrics_text(TEXT)
    b = parse_metrics_text(TEXT.replace("1000.0", "1500.0"))
    assert delta(a, b, "prefix_cache_queries") == 500.0
    assert delta(a, b, "num_preemptions") is None
    assert delta(None, b, "prefix_cache_queries") is None


def test_scraper_polls_in_background(fake_metrics):
    async def go():
        scraper = MetricsScraper(fake_metrics.url, interval=0.05)
        try:
            first = await scraper.scrape()
            scraper.start()
            for _ in range(100):  # bounded: at most ~5 s
                if len(scraper.series) >= 4:
                    break
                await asyncio.sleep(0.05)
            await scraper.stop()
            return first, list(scraper.series)
        finally:
            await scraper.close()

    first, series = asyncio.run(asyncio.wait_for(go(), 20))
    assert first.kv_cache_usage == 0.0 and first.prefix_cache_queries == 0
    assert len(series) >= 4
    assert series[1].prefix_cache_hits == 40 and series[1].prefix_cache_queries == 100
    assert all(b.t > a.t for a, b in zip(series, series[1:], strict=False))


def test_scraper_failure_is_counted_not_raised():
    async def go():
        scraper = MetricsScraper("http://127.0.0.1:9/metrics", timeout=1.0)
        try:
            return await scraper.scrape(), scraper
        finally:
            await scraper.close()

    sample, scraper = asyncio.run(asyncio.wait_for(go(), 10))
    assert sample is None and scraper.num_errors == 1 and scraper.last_error


def test_parse_rejects_garbage():
    with pytest.raises(ValueError):
        parse_metrics_text("not metrics {{{")


def test_parse_reads_the_schedulers_peak_usage_gauge():
    text = TEXT + '# TYPE kvpool_peak_kv_cache_usage_perc gauge\nkvpool_peak_kv_cache_usage_perc{engine="0",model_name="tiny"} 0.625\n'
    assert parse_metrics_text(text).peak_kv_cache_usage == 0.625
    assert parse_metrics_text(TEXT).peak_kv_cache_usage is None
