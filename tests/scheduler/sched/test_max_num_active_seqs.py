"""vLLM 0.32's --max-num-active-seqs: waiting requests are admitted into RUNNING only
while fewer than N run (vLLM's Scheduler.max_num_active_reqs); --max-num-seqs still
sizes the worker's rows. N must be >= 1 and at most --max-num-seqs; unset, the limit
is --max-num-seqs. Counts in the comments are worked out by hand."""

from __future__ import annotations

import pytest
from kvtest.fake_worker import FakeWorker

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.args import config_from_args
from scheduler.sched.policy_options import check_scheduler_options
from scheduler.sched.priority_scheduler import PriorityScheduler
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS, NUM_BLOCKS = 4, 101


def make(cls=Scheduler, max_num_seqs: int = 4, **options):
    kv = KVCacheManager(NUM_BLOCKS, BS, 64, enable_caching=False)
    return cls(kv, max_num_seqs, 100, 64, **options), FakeWorker(NUM_BLOCKS, BS)


def add(sched, rid: str, prompt_len: int = 8, max_tokens: int = 5) -> Request:
    r = Request(rid, [2 + i % 30 for i in range(prompt_len)], max_tokens, seq_id=len(sched.seq_id_to_request), ignore_eos=True)
    sched.add_request(r)
    return r


def step(sched, worker) -> list[str]:
    out = sched.schedule()
    sched.update_from_output(worker.execute(out.plan))
    return [r.request_id for r in out.scheduled]


@pytest.mark.parametrize("cls", [Scheduler, PriorityScheduler])
def test_admission_stops_at_max_num_active_seqs_below_max_num_seqs(cls):
    s, w = make(cls, max_num_active_seqs=2)
    add(s, "a", max_tokens=1)  # done after its prefill step
    for rid in "bcd":
        add(s, rid)
    # 4 waiting, room for 4 rows and 32 of 100 tokens, but only 2 may run: a, b
    assert step(s, w) == ["a", "b"] and s.num_waiting == 2
    # a finished (1 token); b decodes; 1 running < 2 -> c admitted; d waits
    assert step(s, w) == ["b", "c"] and (s.num_running, s.num_waiting) == (2, 1)
    # 2 running: nobody more, though the budget (100 - 2) and the rows (4) have room
    assert step(s, w) == ["b", "c"] and s.num_waiting == 1


def test_unset_the_limit_is_max_num_seqs():
    s, w = make()
    for rid in "abcde":
        add(s, rid)
    assert s.max_num_active_seqs == 4
    # 5 waiting, max_num_seqs 4: a..d admitted, e waits
    assert step(s, w) == ["a", "b", "c", "d"] and s.num_waiting == 1


def test_equal_to_max_num_seqs_changes_nothing():
    s, w = make(max_num_active_seqs=4)
    for rid in "abcde":
        add(s, rid)
    assert step(s, w) == ["a", "b", "c", "d"]


@pytest.mark.parametrize(
    ("value", "message"),
    [(5, "max_num_active_seqs (5) cannot be greater than max_num_seqs (4)."), (0, "--max-num-active-seqs must be >= 1, got 0")],
)
def test_bad_values_are_refused_as_vllm(value, message):
    with pytest.raises(ValueError) as e:
        check_scheduler_options(4, 100, 64, max_num_active_seqs=value)
    assert str(e.value) == message
    with pytest.raises(ValueError, match="cannot be greater|must be >= 1"):
        make(max_num_active_seqs=value)


def test_the_scheduler_process_reads_the_flag_and_checks_it(capsys):
    assert config_from_args(["--max-num-seqs", "8", "--max-num-active-seqs", "3"]).max_num_active_seqs == 3
    assert config_from_args([]).max_num_active_seqs is None
    with pytest.raises(SystemExit) as e:
        config_from_args(["--max-num-seqs", "8", "--max-num-active-seqs", "9"])
    assert e.value.code == 2 and "max_num_active_seqs (9) cannot be greater than max_num_seqs (8)." in capsys.readouterr().err
