"""vLLM 0.32's --max-num-scheduled-tokens through the scheduler: the tokens one step
schedules are capped by it and by --max-num-batched-tokens (vLLM's token_budget and
input_budget, both spent by each request when there are no draft slots), so the
smaller binds; unset, the step's budget is --max-num-batched-tokens. The adaptive
long-prefill floor stays a share of --max-num-batched-tokens (vLLM's input_budget).
Expected counts are worked out by hand in the comments; vLLM 0.32's own Scheduler gives
the same counts on each scenario (checked by building it, from .venv-vllm)."""

from __future__ import annotations

import pytest
from kvtest.fake_worker import FakeWorker

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.args import config_from_args
from scheduler.sched.policy_options import check_scheduler_options
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS = 4


def make(batched: int, scheduled: int | None, **options):
    kv = KVCacheManager(200, BS, 64, enable_caching=False)
    return Scheduler(kv, 8, batched, 64, max_num_scheduled_tokens=scheduled, **options), FakeWorker(200, BS)


def add(sched, rid: str, prompt_len: int, max_tokens: int = 4) -> None:
    sched.add_request(Request(rid, [2 + i % 30 for i in range(prompt_len)], max_tokens, seq_id=len(sched.seq_id_to_request), ignore_eos=True))


def counts(sched, worker) -> tuple[dict[str, int], int]:
    out = sched.schedule()
    got = {r.request_id: out.plan.num_scheduled_tokens.get(r.seq_id, 1) for r in out.scheduled}
    sched.update_from_output(worker.execute(out.plan))
    return got, out.num_scheduled_tokens


def test_a_smaller_cap_splits_the_prompt_step_after_step():
    s, w = make(100, 10)
    add(s, "a", 25)
    # 25 prompt tokens, 10 a step: 10, 10, then the 5 left
    assert [counts(s, w) for _ in range(3)] == [({"a": 10}, 10), ({"a": 10}, 10), ({"a": 5}, 5)]


def test_the_cap_holds_across_running_and_waiting_requests():
    s, w = make(100, 6)
    add(s, "a", 4, max_tokens=8)
    add(s, "b", 4, max_tokens=8)
    add(s, "c", 9, max_tokens=8)
    # step 1: a 4, b 2 (6 - 4 left), c nothing; step 2: a 1 (decode), b its 2 left, c 3 (6 - 1 - 2)
    assert counts(s, w) == ({"a": 4, "b": 2}, 6)
    assert counts(s, w) == ({"a": 1, "b": 2, "c": 3}, 6)


def test_max_num_batched_tokens_binds_when_smaller():
    s, w = make(8, 50)
    add(s, "a", 20)
    assert counts(s, w) == ({"a": 8}, 8)  # min(50, 8)


def test_unset_the_budget_is_max_num_batched_tokens():
    s, w = make(12, None)
    add(s, "a", 20)
    assert s.step_token_budget == 12 and counts(s, w) == ({"a": 12}, 12)


def test_the_adaptive_floor_is_a_share_of_max_num_batched_tokens_not_of_the_cap():
    s, w = make(40, 12, long_prefill_token_threshold=2, long_prefill_token_threshold_adaptive=True)
    add(s, "a", 30)
    add(s, "b", 30)
    # 2 requests: cap max(2, 40 // 2) = 20; a: min(30, 20) = 20, cut to the step's 12; b: none left.
    # (A floor of 12 // 2 = 6 would give a 6 and b 6.)
    assert counts(s, w) == ({"a": 12}, 12)


def test_values_below_1_are_refused_and_1k_is_read_as_vllm():
    with pytest.raises(ValueError, match="--max-num-scheduled-tokens must be >= 1, got 0"):
        check_scheduler_options(8, 100, 64, max_num_scheduled_tokens=0)
    assert config_from_args(["--max-num-scheduled-tokens", "1k"]).max_num_scheduled_tokens == 1000
    assert config_from_args(["--max-num-scheduled-tokens", "1K"]).max_num_scheduled_tokens == 1024
    assert config_from_args([]).max_num_scheduled_tokens is None


def test_the_scheduler_process_refuses_bad_values_naming_the_flag(capsys):
    for argv, message in ((["--max-num-scheduled-tokens", "0"], "--max-num-scheduled-tokens must be >= 1, got 0"),
                          (["--watermark", "1.0"], "--watermark must be in the range [0.0, 1.0) (0.0: off), got 1.0"),
                          (["--watermark", "-0.5"], "--watermark must be in the range [0.0, 1.0) (0.0: off), got -0.5")):
        with pytest.raises(SystemExit) as e:
            config_from_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert config_from_args(["--watermark", "0.01"]).watermark == 0.01
