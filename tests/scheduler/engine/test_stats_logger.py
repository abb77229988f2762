"""The periodic stats line: vLLM's wording, the interval's throughputs, the recent
requests' hit rate, and no INFO noise while idle."""

from __future__ import annotations

import logging

from scheduler.engine.stats_logger import MAX_RECENT_REQUESTS, StatsLogger, StatsSnapshot


def snap(prompt=0, gen=0, preempt=0, reqs=0, queries=0, hits=0, running=0, waiting=0, usage=0.0) -> StatsSnapshot:
    return StatsSnapshot(prompt, gen, preempt, reqs, queries, hits, running, waiting, usage)


def test_the_line_reads_as_vllms_with_the_intervals_rates(caplog):
    stats = StatsLogger(engine_index=0, now=100.0)
    with caplog.at_level(logging.DEBUG, logger="kvpool.scheduler"):
        line = stats.log(snap(prompt=2000, gen=400, reqs=10, queries=2000, hits=1500, running=8, waiting=2, usage=0.4125), now=110.0)
    assert line == (
        "Engine 000: Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 40.0 tokens/s, "
        "Running: 8 reqs, Waiting: 2 reqs, GPU KV cache usage: 41.2%, Prefix cache hit rate: 75.0%"
    )
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, line)]
    # The next interval: deltas only, and its preemptions named.
    line = stats.log(snap(prompt=2500, gen=900, preempt=3, reqs=12, queries=2500, hits=1500, running=1, usage=0.1), now=115.0)
    assert "Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 100.0 tokens/s" in line
    assert "Waiting: 0 reqs, Preemptions: 3, GPU KV cache usage: 10.0%" in line
    assert line.endswith("Prefix cache hit rate: 60.0%")  # 1500 / 2500 over both intervals


def test_an_idle_engine_logs_at_debug_after_one_quiet_line(caplog):
    stats = StatsLogger(engine_index=3, now=0.0)
    with caplog.at_level(logging.DEBUG, logger="kvpool.scheduler"):
        stats.log(snap(gen=10), now=10.0)
        stats.log(snap(gen=10), now=20.0)  # nothing new, but the last interval had work: INFO
        stats.log(snap(gen=10), now=30.0)  # idle after idle: DEBUG
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]
    assert caplog.records[0].getMessage().startswith("Engine 003: ")


def test_the_hit_rate_follows_the_recent_requests():
    stats = StatsLogger(engine_index=0, now=0.0)
    # A first workload of all hits, then more than the window of misses.
    stats.log(snap(reqs=500, queries=5000, hits=5000), now=1.0)
    assert stats.hit_rate == 1.0
    stats.log(snap(reqs=500 + MAX_RECENT_REQUESTS, queries=5000 + 10_000, hits=5000), now=2.0)
    assert stats.hit_rate == 0.0  # the old intervals left the window
