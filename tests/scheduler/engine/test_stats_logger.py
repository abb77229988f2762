"""The periodic stats line: vLLM's wording, the interval's throughputs, the recent
requests' hit rate, and no INFO noise while idle."""

from __future__ import annotations

import logging
import signal
import time

import pytest
from kvtest.scheduler_harness import Setup, prompt_of

from scheduler.engine.args import config_from_args
from scheduler.engine.stats_logger import MAX_RECENT_REQUESTS, StatsLogger, StatsSnapshot


def snap(prompt=0, gen=0, preempt=0, reqs=0, queries=0, hits=0, running=0, waiting=0, usage=0.0) -> StatsSnapshot:
    return StatsSnapshot(prompt, gen, preempt, reqs, queries, hits, running, waiting, usage)


def test_the_line_reads_as_vllms_with_the_intervals_rates(caplog):
    stats = StatsLogger(engine_index=0, now=100.0)
    with caplog.at_level(logging.DEBUG, logger="scheduler"):
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
    with caplog.at_level(logging.DEBUG, logger="scheduler"):
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


def _served_a_request_and_stopped(*args: str) -> str:
    """The log of a scheduler process that served one request through a fake worker
    and then stopped, with a stats line every 0.3 s unless turned off."""
    s = Setup("--log-level", "INFO", *args, env_extra={"VLLM_LOG_STATS_INTERVAL": "0.3"})
    try:
        s.client.generate("r", prompt_of(1, 40), max_tokens=20)
        time.sleep(1.0)  # a few intervals, the last ones idle
        s.sched.proc.send_signal(signal.SIGTERM)
        assert s.sched.proc.wait(timeout=30) == 0
        return s.sched.output()
    finally:
        s.close()


@pytest.mark.e2e
def test_the_scheduler_logs_its_stats_line_while_serving():
    log = _served_a_request_and_stopped()
    lines = [line for line in log.splitlines() if "Avg prompt throughput" in line]
    assert lines, log
    assert all(" INFO scheduler: Engine 000: Avg prompt throughput: " in line for line in lines), lines
    assert any("Running: " in line and "GPU KV cache usage: " in line and "Prefix cache hit rate: " in line for line in lines)
    # Idle after idle goes to DEBUG: not every interval of the quiet second is logged at INFO.
    assert len(lines) < 1.0 / 0.3 + 3


@pytest.mark.e2e
def test_disable_log_stats_turns_the_line_off():
    log = _served_a_request_and_stopped("--disable-log-stats")
    assert "Avg prompt throughput" not in log


def test_a_bad_interval_is_refused_by_name(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "soon")
    with pytest.raises(SystemExit) as e:
        config_from_args([])
    assert e.value.code == 2 and "VLLM_LOG_STATS_INTERVAL must be a positive number of seconds, got 'soon'" in capsys.readouterr().err
