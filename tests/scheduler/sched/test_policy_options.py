"""vLLM 0.32's scheduling options (scheduler/sched/policy_options.py) through the
scheduler: the long-prefill cap (running and waiting requests alike, off while a
request is alone, floored at a fair share when adaptive), chunked prefill off (a
waiting request is not split; the cap still splits it, as vLLM applies the cap
first), and the config checks in vLLM's words with the flags' names. Expected
token counts are worked out by hand from the rule in each comment."""

from __future__ import annotations

import re

import pytest
from kvtest.fake_worker import FakeWorker

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.policy_options import check_scheduler_options, long_prefill_cap
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS = 4


def make(budget: int, max_model_len: int = 64, **options):
    kv = KVCacheManager(200, BS, max_model_len, enable_caching=False)
    return Scheduler(kv, 8, budget, max_model_len, **options), FakeWorker(200, BS)


def add(sched, rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    r = Request(rid, [2 + i % 30 for i in range(prompt_len)], max_tokens, seq_id=len(sched.seq_id_to_request), ignore_eos=True)
    sched.add_request(r)
    return r


def counts(sched, worker) -> dict[str, int]:
    """One step: the tokens each scheduled request got."""
    out = sched.schedule()
    got = {r.request_id: out.plan.num_scheduled_tokens.get(r.seq_id, 1) for r in out.scheduled}
    sched.update_from_output(worker.execute(out.plan))
    return got


def test_the_cap_holds_running_and_waiting_requests_and_lifts_when_one_is_left():
    s, w = make(100, long_prefill_token_threshold=6)
    add(s, "a", 20)
    add(s, "b", 3, max_tokens=1)
    # 2 requests: cap 6. a: min(20, 6) = 6; b: 3 (under the cap), done after its 1 token.
    assert counts(s, w) == {"a": 6, "b": 3}
    # a alone (b finished): no cap, nobody to starve: the 14 left in one step.
    assert counts(s, w) == {"a": 14}


def test_the_cap_splits_a_running_prefill_step_after_step():
    s, w = make(100, long_prefill_token_threshold=6)
    add(s, "a", 20, max_tokens=8)
    add(s, "b", 3, max_tokens=8)
    # cap 6 while both run: a 6, 6, 6, then the 2 left; b its 3, then a token a step.
    assert [counts(s, w) for _ in range(4)] == [{"a": 6, "b": 3}, {"a": 6, "b": 1}, {"a": 6, "b": 1}, {"a": 2, "b": 1}]


def test_without_the_option_a_prompt_takes_what_the_budget_gives():
    s, w = make(100)
    add(s, "a", 20)
    add(s, "b", 3)
    assert counts(s, w) == {"a": 20, "b": 3}


@pytest.mark.parametrize(("adaptive", "expected"), [(False, [2, 2, 2, 2, 2]), (True, [4, 4, 2])])
def test_adaptive_floors_the_cap_at_a_fair_share_of_the_budget(adaptive, expected):
    # Three 10-token prompts, budget 12, threshold 2: the cap is 2, or adaptive
    # max(2, 12 // 3 requests) = 4 (then the 2 left of each).
    s, w = make(12, long_prefill_token_threshold=2, long_prefill_token_threshold_adaptive=adaptive)
    for rid in "xyz":
        add(s, rid, 10)
    for n in expected:
        assert counts(s, w) == {"x": n, "y": n, "z": n}


def test_without_chunked_prefill_a_waiting_prompt_is_not_split_and_nobody_overtakes_it():
    # Budget 8 = max_model_len. a takes 5; b's 4 do not fit the 3 left: b waits whole,
    # and c (2, which would fit) waits behind it (admission stops at the head).
    s, w = make(8, max_model_len=8, enable_chunked_prefill=False)
    add(s, "a", 5, max_tokens=2)
    add(s, "b", 4, max_tokens=2)
    add(s, "c", 2, max_tokens=2)
    assert counts(s, w) == {"a": 5}
    assert counts(s, w) == {"a": 1, "b": 4, "c": 2}  # budget 8: 1 + 4 + 2
    # The same with chunked prefill: b is split (3 now, 1 next step); c comes next step.
    s, w = make(8, max_model_len=8)
    add(s, "a", 5, max_tokens=2)
    add(s, "b", 4, max_tokens=2)
    add(s, "c", 2, max_tokens=2)
    assert counts(s, w) == {"a": 5, "b": 3}
    assert counts(s, w) == {"a": 1, "b": 1, "c": 2}


def test_the_cap_still_splits_a_prompt_without_chunked_prefill_as_vllm():
    # vLLM caps at the threshold before the chunked-prefill check: a's 7 become 3 a step.
    s, w = make(8, max_model_len=8, enable_chunked_prefill=False, long_prefill_token_threshold=3)
    add(s, "a", 7, max_tokens=1)
    add(s, "b", 2, max_tokens=1)
    assert counts(s, w) == {"a": 3, "b": 2}
    assert counts(s, w) == {"a": 4}  # alone now: no cap, the 4 left whole


def test_long_prefill_cap_rule():
    assert long_prefill_cap(0, False, 100, 5) == 0  # off
    assert long_prefill_cap(8, False, 100, 1) == 0  # alone
    assert long_prefill_cap(8, False, 100, 2) == 8
    assert long_prefill_cap(8, True, 100, 5) == 20  # 100 // 5
    assert long_prefill_cap(8, True, 100, 50) == 8  # 100 // 50 = 2 < 8


@pytest.mark.parametrize(
    ("args", "options", "message"),
    [
        ((8, 2048, 4096), {"enable_chunked_prefill": False},
         re.escape("--max-num-batched-tokens (2048) is smaller than --max-model-len (4096) with --no-enable-chunked-prefill")),
        ((8, 2048, 4096), {"long_prefill_token_threshold": 4097},
         r"--long-prefill-token-threshold \(4097\) cannot be greater than the --max-model-len \(4096\)"),
        ((8, 2048, 4096), {"long_prefill_token_threshold": -1}, "--long-prefill-token-threshold must be >= 0"),
        ((0, 2048, 4096), {}, "max_num_seqs and max_num_batched_tokens must be >= 1"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(args, options, message):
    with pytest.raises(ValueError, match=message):
        check_scheduler_options(*args, **options)
    with pytest.raises(ValueError, match=message):
        Scheduler(KVCacheManager(16, BS, args[2]), *args, **options)


def test_good_options_pass():
    check_scheduler_options(8, 4096, 4096, enable_chunked_prefill=False, long_prefill_token_threshold=4096)
    check_scheduler_options(8, 16, 4096, long_prefill_token_threshold=0)
