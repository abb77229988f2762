"""vLLM 0.32's --watermark through the scheduler: admitting a waiting (or preempted)
request while another runs must leave int(watermark * num_gpu_blocks) blocks free
(vLLM's KVCacheManager.watermark_blocks, the null block counted), in both of
allocate_slots' checks (the chunk and, with scheduler_reserve_full_isl, the whole
sequence); alone, a request is admitted without it; running requests grow into it.

Pool: 11 blocks of 4 tokens, block 0 the null block, so 10 free at the start;
watermark 0.2 -> int(0.2 * 11) = int(2.2) = 2 blocks kept free. Free counts in the
comments are worked out by hand ("free: 10" = ten blocks in the free queue); vLLM 0.32's
own Scheduler, built on the same 11-block pool (.venv-vllm), schedules every scenario here
the same, step by step, with the same free counts."""

from __future__ import annotations

import pytest
from kvtest.fake_worker import FakeWorker

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.policy_options import check_scheduler_options
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BS, NUM_BLOCKS = 4, 11


def make(watermark: float, budget: int = 100, **options):
    kv = KVCacheManager(NUM_BLOCKS, BS, 64, enable_caching=False)
    return Scheduler(kv, 8, budget, 64, watermark=watermark, **options), FakeWorker(NUM_BLOCKS, BS)


def add(sched, rid: str, prompt_len: int, max_tokens: int = 30) -> Request:
    r = Request(rid, [2 + i % 30 for i in range(prompt_len)], max_tokens, seq_id=len(sched.seq_id_to_request), ignore_eos=True)
    sched.add_request(r)
    return r


def step(sched, worker) -> list[str]:
    out = sched.schedule()
    sched.update_from_output(worker.execute(out.plan))
    return [r.request_id for r in out.scheduled]


def free(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.mark.parametrize(("watermark", "blocks"), [(0.0, 0), (0.2, 2), (0.18, 1), (0.19, 2), (0.5, 5), (0.99, 10)])
def test_the_watermark_is_int_of_the_fraction_of_every_block_null_included(watermark, blocks):
    # 0.18 * 11 = 1.98 -> 1; 0.19 * 11 = 2.09 -> 2; 0.99 * 11 = 10.89 -> 10
    assert make(watermark)[0].watermark_blocks == blocks


def test_alone_a_request_may_take_the_whole_pool_watermark_or_not():
    s, w = make(0.2)
    add(s, "a", 40, max_tokens=1)
    # nothing runs: no watermark. a: 40 tokens = 10 blocks of the 10 free -> admitted, free: 0
    assert step(s, w) == ["a"]


def _one_running(watermark: float, **options):
    """a (12 tokens, 3 blocks) admitted, then decoding: after two steps it holds 4 blocks."""
    s, w = make(watermark, **options)
    add(s, "a", 12)
    assert step(s, w) == ["a"]  # free: 10 - 3 = 7 (a: 12 prompt tokens computed, 1 sampled)
    return s, w


def test_a_waiting_request_must_leave_the_watermark_free_while_another_runs():
    s, w = _one_running(0.2)
    add(s, "b", 20)
    # a's 13th token needs its 4th block: free 7 -> 6. b: 20 tokens = 5 blocks; 5 + 2 > 6 -> waits
    assert step(s, w) == ["a"] and free(s) == 6 and s.num_waiting == 1
    s2, w2 = _one_running(0.0)
    add(s2, "b", 20)
    # no watermark: 5 <= 6 -> b admitted, free: 1
    assert step(s2, w2) == ["a", "b"] and free(s2) == 1


def test_exactly_the_watermark_left_is_enough():
    s, w = _one_running(0.2)
    add(s, "c", 16)
    # free 7 -> 6 (a's 4th block); c: 16 tokens = 4 blocks; 4 + 2 = 6, not > 6 -> admitted, free: 2
    assert step(s, w) == ["a", "c"] and free(s) == 2


def test_the_whole_sequence_check_keeps_the_watermark_too():
    # from the second step, budget 9: a's decode token, then 8 tokens of b (2 blocks); b's whole 20 tokens: 5 blocks.
    s, w = _one_running(0.2)
    s.max_num_batched_tokens = 9
    add(s, "b", 20)
    # free 6 after a's block. Chunk: 2 + 2 <= 6, but whole sequence: 5 + 2 > 6 -> waits
    assert step(s, w) == ["a"] and s.num_waiting == 1
    s2, w2 = _one_running(0.2, reserve_full_sequence=False)
    s2.max_num_batched_tokens = 9
    add(s2, "b", 20)
    # without scheduler_reserve_full_isl only the chunk is checked: 2 + 2 <= 6 -> admitted, free: 4
    assert step(s2, w2) == ["a", "b"] and free(s2) == 4


def test_running_requests_grow_into_the_watermark():
    s, w = make(0.2)
    add(s, "a", 36, max_tokens=8)
    # alone: 36 tokens = 9 blocks, free: 1 (inside the watermark: only admissions keep it)
    assert step(s, w) == ["a"] and free(s) == 1
    # a's 37th token needs a 10th block: taken, free: 0
    assert step(s, w) == ["a"] and free(s) == 0


def _preempted_then_room(watermark: float):
    s, w = make(watermark)
    add(s, "a", 12, max_tokens=6)
    add(s, "b", 4, max_tokens=3)
    add(s, "c", 16, max_tokens=8)
    # step 1: a 3 blocks (alone: no watermark), free 7; b 1 block, 1 + 2 <= 7, free 6;
    #         c 4 blocks, 4 + 2 <= 6, free 2 (with watermark 0 the same: 3 + 1 + 4 of 10)
    assert step(s, w) == ["a", "b", "c"] and free(s) == 2
    # step 2: a's 13th token takes block 4 (free 1), b's 5th block 2 (free 0); c's 17th
    #         needs a 5th: none free, c (the last running) preempts itself: free 4
    assert step(s, w) == ["a", "b"] and s.requests["c"].status == RequestStatus.PREEMPTED and free(s) == 4
    # step 3: c (17 tokens: 5 blocks) > 4 free: waits either way; b's 3rd token: b ends, free 6
    assert step(s, w) == ["a", "b"] and free(s) == 6
    return step(s, w)


def test_a_preempted_request_is_readmitted_under_the_watermark():
    # step 4, a still running: c needs 5 of the 6 free. No watermark: admitted;
    # watermark 2: 5 + 2 > 6, c waits.
    assert _preempted_then_room(0.0) == ["a", "c"]
    assert _preempted_then_room(0.2) == ["a"]


@pytest.mark.parametrize("bad", [1.0, -0.1, 1.5, float("nan")])
def test_the_range_is_vllms_0_inclusive_to_1_exclusive(bad):
    with pytest.raises(ValueError, match=r"--watermark must be in the range \[0.0, 1.0\)"):
        check_scheduler_options(8, 100, 64, watermark=bad)
    with pytest.raises(ValueError, match="--watermark"):
        make(bad)
