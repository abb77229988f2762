"""The waiting queue (scheduler/sched/request_queue.py), through the scheduler:
aborting waiting requests costs O(1) (amortized) wherever they stand, the queue's order
and count are exactly those of the requests still waiting, and the head is always one
that waits (the scheduler admits from it)."""

from __future__ import annotations

import random
from collections import deque

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.request_queue import MIN_ENDED_TO_REBUILD
from scheduler.sched.scheduler import Scheduler


def make(n: int) -> tuple[Scheduler, list[Request]]:
    kv = KVCacheManager(num_gpu_blocks=64, block_size=4, max_model_len=64, enable_caching=False)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    reqs = [Request(f"r{i}", [2 + i % 50, 3, 4, 5], 2, seq_id=i) for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    return sched, reqs


def live_order(sched: Scheduler) -> list[str]:
    return [r.request_id for r in sched.waiting]


def test_aborts_anywhere_keep_the_order_the_count_and_a_live_head():
    rng = random.Random(7)
    sched, reqs = make(300)
    expected = [r.request_id for r in reqs]
    for _ in range(250):
        rid = rng.choice(expected)
        expected.remove(rid)
        (ended,) = sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        assert ended.status is RequestStatus.FINISHED_ABORTED
        assert sched.num_waiting == len(expected) == len(live_order(sched))
        assert live_order(sched) == expected
        if sched.waiting:
            assert not sched.waiting.head.status.is_finished
    assert all((r in sched.waiting) == (r.request_id in expected) for r in reqs)
    # The ended left in place never outnumber the waiting by much: the queue is rebuilt.
    # (White-box: the deque behind the queue.)
    assert len(sched.waiting._queue) <= 2 * sched.num_waiting + MIN_ENDED_TO_REBUILD + 1


def test_the_last_waiting_request_ended_leaves_an_empty_queue():
    sched, reqs = make(5)
    for rid in ("r2", "r1", "r3", "r0", "r4"):
        sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and not sched.waiting and not sched.requests


def test_admission_skips_requests_ended_in_the_middle():
    sched, reqs = make(8)
    sched.finish_requests(["r1", "r2"], RequestStatus.FINISHED_ABORTED)  # behind r0, in the middle
    out = sched.schedule()
    assert [r.request_id for r in out.scheduled] == ["r0", "r3", "r4", "r5"]  # max_num_seqs 4
    assert sched.num_waiting == 2 and live_order(sched) == ["r6", "r7"]
    assert not sched.waiting.head.status.is_finished


class _NoScanDeque(deque):
    """The waiting queue, refusing every full pass over itself."""

    scans = 0

    def __iter__(self):
        type(self).scans += 1
        return super().__iter__()

    def remove(self, value):
        raise AssertionError("deque.remove scans the whole queue")


def test_two_thousand_aborts_at_the_back_of_a_long_queue_scan_it_not_once():
    sched, reqs = make(20_000)
    sched.waiting._queue = _NoScanDeque(sched.waiting._queue)  # white-box: the deque behind the queue
    # One by one from just before the back: with deque.remove, each was a scan of 20,000.
    for r in reversed(reqs[-2001:-1]):
        sched.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    assert _NoScanDeque.scans == 0
    assert sched.num_waiting == 18_000
    assert live_order(sched) == [r.request_id for r in reqs[:-2001]] + [reqs[-1].request_id]
