"""Speculative decoding's counters, exported as vLLM 0.32 does: the ``vllm:spec_decode_*``
Prometheus families (SpecDecodingProm) only with --speculative-config, and the
SpecDecodingLogging line after the stats line of an interval that had drafts. Every
expected value is worked out by hand here."""

from __future__ import annotations

import logging

from kvtest.scheduler_harness import parse_metrics

from protocol.speculative_config import SpeculativeConfig
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.engine_state import EngineState
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.stats_logger import (
    SpecDecodingLogger,
    SpecSnapshot,
    StatsLogger,
    StatsSnapshot,
    stats_snapshot,
)
from scheduler.sched.scheduler import Scheduler

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2)
LABELS = 'engine="0",model_name="m"'
COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def make_scheduler(
    speculative: SpeculativeConfig | None = SPEC,
) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(32, 4, 64, enable_caching=True)
    return Scheduler(kv, 8, 64, 64, speculative=speculative), kv


def spec_values(m: SchedulerMetrics) -> dict[str, float]:
    """The four families' samples: drafts, draft_tokens, accepted, pos0..pos2."""
    v = parse_metrics(m.render().decode())
    drafts, draft_tokens, accepted = (v[f"{name}_total{{{LABELS}}}"] for name in COUNTERS)
    out = dict(drafts=drafts, draft_tokens=draft_tokens, accepted=accepted)
    for pos in range(3):
        out[f"pos{pos}"] = v[f'{PER_POS}_total{{{LABELS},position="{pos}"}}']
    return out


def test_the_families_are_vllms_and_follow_the_schedulers_counters():
    sched, kv = make_scheduler()
    m = SchedulerMetrics("m", speculative=SPEC)
    text = m.render().decode()
    # vLLM's help texts; every position's child exported from the start, at 0.
    assert "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts." in text
    assert "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens." in text
    assert "# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens." in text
    assert (
        "# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position."
        in text
    )
    assert "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter" in text
    assert spec_values(m) == dict(drafts=0, draft_tokens=0, accepted=0, pos0=0, pos1=0, pos2=0)
    assert 'position="3"' not in text

    # Two drafts of 3 tokens, 3 and 1 accepted: positions 0 (both), 1 and 2 (the first).
    sched.spec_stats.observe_draft(3, 3)
    sched.spec_stats.observe_draft(3, 1)
    m.update(sched, kv)
    assert spec_values(m) == dict(drafts=2, draft_tokens=6, accepted=4, pos0=2, pos1=1, pos2=1)

    # Then 2 drafted none accepted, 3 drafted 2 accepted: the counters go on from there.
    sched.spec_stats.observe_draft(2, 0)
    sched.spec_stats.observe_draft(3, 2)
    m.update(sched, kv)
    m.update(sched, kv)  # an update with nothing new adds nothing
    assert spec_values(m) == dict(drafts=4, draft_tokens=11, accepted=6, pos0=3, pos1=2, pos2=1)


def test_without_speculative_decoding_no_family_is_registered():
    sched, kv = make_scheduler(speculative=None)
    assert sched.spec_stats is None
    m = SchedulerMetrics("m")
    m.update(sched, kv)
    text = m.render().decode()
    assert "spec_decode" not in text
    assert "vllm:generation_tokens_total" in text  # the rest is there


def test_metrics_built_without_the_config_register_them_at_the_first_update():
    sched, kv = make_scheduler()
    m = SchedulerMetrics("m")
    assert "spec_decode" not in m.render().decode()
    sched.spec_stats.observe_draft(3, 2)
    m.update(sched, kv)
    assert spec_values(m) == dict(drafts=1, draft_tokens=3, accepted=2, pos0=1, pos1=1, pos2=0)


def snap(gen: int, spec: SpecSnapshot | None) -> StatsSnapshot:
    return StatsSnapshot(0, gen, 0, 0, 0, 0, 1, 0, 0.0, spec)


def test_the_log_line_reads_as_vllms_after_the_stats_line(caplog):
    stats = StatsLogger(engine_index=0, now=100.0)
    # 2 drafts of 3 tokens, 3 and 1 accepted, over 10 s: mean acceptance length
    # 1 + 4/2 = 3.00, 4/10 = 0.40 and 6/10 = 0.60 tokens/s, per position 2/2, 1/2, 1/2,
    # 4/6 = 66.7% accepted.
    with caplog.at_level(logging.DEBUG, logger="scheduler"):
        line = stats.log(snap(6, SpecSnapshot(2, 6, 4, (2, 1, 1))), now=110.0)
    expected = (
        "SpecDecoding metrics: Mean acceptance length: 3.00, Accepted throughput: 0.40 tokens/s, "
        "Drafted throughput: 0.60 tokens/s, Accepted: 4 tokens, Drafted: 6 tokens, "
        "Per-position acceptance rate: 1.000, 0.500, 0.500, Avg Draft acceptance rate: 66.7%"
    )
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, line),
        (logging.INFO, expected),
    ]


def test_an_interval_without_drafts_logs_no_line_and_keeps_vllms_clock(caplog):
    stats = StatsLogger(engine_index=0, now=0.0)
    with caplog.at_level(logging.DEBUG, logger="scheduler"):
        stats.log(snap(0, SpecSnapshot(0, 0, 0, (0, 0, 0))), now=10.0)
        assert not any(r.getMessage().startswith("SpecDecoding") for r in caplog.records)
        stats.log(snap(4, SpecSnapshot(0, 0, 0, (0, 0, 0))), now=20.0)
        assert not any(r.getMessage().startswith("SpecDecoding") for r in caplog.records)
        # Then 3 drafts (3, 2 and 1 tokens; 2, 0 and 1 accepted): vLLM resets its clock
        # only when it logs the line, so the rates are over all 30 s: 3/30 = 0.10 and
        # 6/30 = 0.20 tokens/s; 1 + 3/3 = 2.00; positions 2/3, 1/3, 0/3; 3/6 = 50.0%.
        stats.log(snap(9, SpecSnapshot(3, 6, 3, (2, 1, 0))), now=30.0)
    spec_lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("SpecDecoding")
    ]
    assert spec_lines == [
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 0.10 tokens/s, "
        "Drafted throughput: 0.20 tokens/s, Accepted: 3 tokens, Drafted: 6 tokens, "
        "Per-position acceptance rate: 0.667, 0.333, 0.000, Avg Draft acceptance rate: 50.0%"
    ]


def test_each_line_covers_the_drafts_since_the_previous_one():
    spec = SpecDecodingLogger(now=0.0)
    assert spec.log(SpecSnapshot(2, 6, 4, (2, 1, 1)), now=10.0).startswith(
        "SpecDecoding metrics: Mean acceptance length: 3.00,"
    )
    assert spec.log(SpecSnapshot(2, 6, 4, (2, 1, 1)), now=15.0) is None  # no draft since
    # Since the first line (at 10 s): 2 drafts of 2 and 3 tokens, 0 and 2 accepted, over 10 s.
    assert spec.log(SpecSnapshot(4, 11, 6, (3, 2, 1)), now=20.0) == (
        "SpecDecoding metrics: Mean acceptance length: 2.00, Accepted throughput: 0.20 tokens/s, "
        "Drafted throughput: 0.50 tokens/s, Accepted: 2 tokens, Drafted: 5 tokens, "
        "Per-position acceptance rate: 0.500, 0.500, 0.000, Avg Draft acceptance rate: 40.0%"
    )


def test_the_line_follows_the_stats_lines_level_while_idle(caplog):
    stats = StatsLogger(engine_index=0, now=0.0)
    with caplog.at_level(logging.DEBUG, logger="scheduler"):
        # Idle before and now (no tokens), so both lines at DEBUG, as vLLM's log_fn.
        stats.log(snap(0, SpecSnapshot(1, 3, 3, (1, 1, 1))), now=10.0)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]


def test_the_snapshot_copies_the_schedulers_counters():
    state = EngineState()
    assert stats_snapshot(state) is None
    state.scheduler, state.kv = make_scheduler()
    state.scheduler.spec_stats.observe_draft(3, 3)
    state.scheduler.spec_stats.observe_draft(3, 1)
    s = stats_snapshot(state)
    assert s.spec == SpecSnapshot(2, 6, 4, (2, 1, 1))
    state.scheduler.spec_stats.observe_draft(1, 1)  # a copy: later drafts leave it as it was
    assert s.spec == SpecSnapshot(2, 6, 4, (2, 1, 1))
    state.scheduler, state.kv = make_scheduler(speculative=None)
    assert stats_snapshot(state).spec is None
