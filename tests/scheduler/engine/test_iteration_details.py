"""--enable-logging-iteration-details: one line per step, vLLM 0.32's wording
(LoggingStatLogger._log_iteration_details) and counts (compute_iteration_details: a
request is a context request while it has no output token). Counts by hand below."""

from __future__ import annotations

import logging
import re
import signal

import pytest
from kvtest.fake_worker import FakeWorker
from kvtest.scheduler_harness import Setup, prompt_of

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.args import config_from_args
from scheduler.engine.stats_logger import IterationDetailsLogger
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS, NUM_BLOCKS = 4, 101  # 100 usable blocks: one block is 1.0% usage
ELAPSED = r"iteration elapsed time: \d+\.\d\d ms"


def run_step(sched, worker, details: IterationDetailsLogger) -> str:
    out = sched.schedule()
    details.begin(out)
    sched.update_from_output(worker.execute(out.plan))
    return details.end(sched.kv_cache_manager)


def test_counts_and_wording_step_by_step(caplog):
    kv = KVCacheManager(NUM_BLOCKS, BS, 64, enable_caching=False)
    s, w = Scheduler(kv, 8, 10, 64), FakeWorker(NUM_BLOCKS, BS)
    for seq_id, rid in enumerate("ab"):
        s.add_request(Request(rid, [2 + i for i in range(8)], 5, seq_id=seq_id, ignore_eos=True))
    details = IterationDetailsLogger(True, 2)
    with caplog.at_level(logging.INFO, logger="scheduler"):
        # budget 10: a's prompt (8) and 2 tokens of b's; usage after: a 2 blocks, b 1 -> 3%
        line0 = run_step(s, w, details)
        # a decodes (1 output: generation, 1 token); b's last 6 prompt tokens (context);
        # a 10 tokens -> 3 blocks, b 8 -> 2: 5%
        line1 = run_step(s, w, details)
        # the worker lost: a (2 outputs, 10 tokens) recomputes all 10 as a generation request;
        # b (1 output) waits, the budget spent; read before any result: a's 10 tokens, 3 blocks
        s.preempt_all()
        details.begin(s.schedule())
        line2 = details.end(kv)
    assert re.fullmatch(r"Engine 002: Iteration\(0\): 2 context requests, 10 context tokens, 0 generation requests, "
                        rf"0 generation tokens, {ELAPSED}, GPU KV cache usage: 3\.0%", line0), line0
    assert re.fullmatch(r"Engine 002: Iteration\(1\): 1 context requests, 6 context tokens, 1 generation requests, "
                        rf"1 generation tokens, {ELAPSED}, GPU KV cache usage: 5\.0%", line1), line1
    assert re.fullmatch(r"Engine 002: Iteration\(2\): 0 context requests, 0 context tokens, 1 generation requests, "
                        rf"10 generation tokens, {ELAPSED}, GPU KV cache usage: 3\.0%", line2), line2
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [(logging.INFO, x) for x in (line0, line1, line2)]


def test_off_it_logs_nothing(caplog):
    details = IterationDetailsLogger(False, 0)
    with caplog.at_level(logging.DEBUG, logger="scheduler"):
        details.begin(None)  # never even looked at
        assert details.end(None) is None
    assert caplog.records == []


def test_the_flag_is_off_by_default_in_the_scheduler_process():
    assert config_from_args([]).enable_logging_iteration_details is False
    assert config_from_args(["--enable-logging-iteration-details"]).enable_logging_iteration_details is True


def _served(*args: str) -> str:
    s = Setup("--log-level", "INFO", "--enable-logging-iteration-details", *args)
    try:
        s.client.generate("r", prompt_of(1, 40), max_tokens=3)
        s.sched.proc.send_signal(signal.SIGTERM)
        assert s.sched.proc.wait(timeout=30) == 0
        return s.sched.output()
    finally:
        s.close()


@pytest.mark.e2e
def test_the_scheduler_process_logs_each_step():
    log = _served()
    lines = [line for line in log.splitlines() if "Iteration(" in line]
    # 40 prompt tokens in one step (budget 2048), then 2 decode steps; max_tokens 3
    assert len(lines) == 3, log
    assert " INFO scheduler: Engine 000: Iteration(0): 1 context requests, 40 context tokens, 0 generation requests, " \
           "0 generation tokens, iteration elapsed time: " in lines[0]
    for i in (1, 2):
        assert f"Iteration({i}): 0 context requests, 0 context tokens, 1 generation requests, 1 generation tokens" in lines[i]


@pytest.mark.e2e
def test_disable_log_stats_turns_the_details_off_too():
    assert "Iteration(" not in _served("--disable-log-stats")
