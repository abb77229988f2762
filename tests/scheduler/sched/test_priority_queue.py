"""The priority waiting queue (scheduler/sched/request_queue.py, vLLM's
``PriorityRequestQueue``): admission order by (priority, arrival_time), then
request_id; a preempted request goes back in by its key; aborts anywhere cost
O(log n) amortized (lazy deletion), never a scan of the heap."""

from __future__ import annotations

import random

import pytest

from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.request_queue import (
    MIN_ENDED_TO_REBUILD,
    PriorityWaitingQueue,
    WaitingQueue,
    create_request_queue,
)


def req(rid: str, priority: int, arrival: float) -> Request:
    return Request(rid, [2, 3], 1, priority=priority, arrival_time=arrival)


def drain(q) -> list[str]:
    out = []
    while q:
        out.append(q.popleft().request_id)
    return out


def test_lower_priority_value_first_then_earlier_arrival_then_request_id():
    q = PriorityWaitingQueue()
    for r in (req("late-urgent", -1, 9.0), req("b", 0, 2.0), req("a", 0, 2.0), req("first", 0, 1.0), req("lazy", 5, 0.0)):
        q.append(r)
    # heap keys: (-1, 9.0) < (0, 1.0) < (0, 2.0, "a") < (0, 2.0, "b") < (5, 0.0)
    assert q.head.request_id == "late-urgent"
    assert [r.request_id for r in q] == ["late-urgent", "first", "a", "b", "lazy"]
    assert len(q) == 5
    assert drain(q) == ["late-urgent", "first", "a", "b", "lazy"]
    assert not q and len(q) == 0


def test_a_preempted_request_goes_back_by_its_key_not_to_the_front():
    # FCFS puts a victim at the front; a heap has no front (vLLM: prepend_request = add_request).
    q = PriorityWaitingQueue()
    q.append(req("w", 0, 5.0))
    victim = req("v", 1, 1.0)
    q.appendleft(victim)
    assert drain(q) == ["w", "v"]
    fcfs = WaitingQueue()
    fcfs.append(req("w", 0, 5.0))
    fcfs.appendleft(req("v", 1, 1.0))
    assert drain(fcfs) == ["v", "w"]  # the priority field changes nothing here


def end(q, r: Request) -> None:
    r.status = RequestStatus.FINISHED_ABORTED
    q.remove_ended(r)


def test_aborts_anywhere_keep_the_order_the_count_and_a_live_head():
    rng = random.Random(3)
    q = PriorityWaitingQueue()
    reqs = [req(f"r{i:03d}", rng.randrange(4), rng.random()) for i in range(300)]
    for r in reqs:
        q.append(r)
    expected = sorted(reqs, key=lambda r: (r.priority, r.arrival_time, r.request_id))
    for _ in range(250):
        r = rng.choice(expected)
        expected.remove(r)
        end(q, r)
        assert len(q) == len(expected)
        assert [x.request_id for x in q] == [x.request_id for x in expected]
        if q:
            assert q.head is expected[0]  # the head always waits
        assert r not in q
    # The ended left in the heap never outnumber the waiting by much: it is rebuilt.
    assert len(q._heap) <= 2 * len(q) + MIN_ENDED_TO_REBUILD + 1
    assert drain(q) == [x.request_id for x in expected]


def test_the_last_waiting_request_ended_leaves_an_empty_queue():
    q = PriorityWaitingQueue()
    rs = [req(f"r{i}", i % 2, float(i)) for i in range(5)]
    for r in rs:
        q.append(r)
    for i in (3, 1, 0, 4, 2):
        end(q, rs[i])
    assert not q and len(q) == 0


class _NoScanList(list):
    """The heap behind the queue, refusing every pass over itself (heapq works on the
    list's items directly, without these)."""

    def __iter__(self):
        raise AssertionError("a full pass over the heap")

    def remove(self, value):
        raise AssertionError("list.remove scans the heap (vLLM's remove_request)")

    def index(self, *args):
        raise AssertionError("list.index scans the heap")


def test_two_thousand_aborts_in_a_long_queue_scan_it_not_once():
    q = PriorityWaitingQueue()
    rs = [req(f"r{i:05d}", i % 7, i * 1e-3) for i in range(20_000)]
    for r in rs:
        q.append(r)
    q._heap = _NoScanList(q._heap)  # white-box: the list behind the heap
    for r in rs[5_000:7_000]:
        end(q, r)
    for _ in range(100):
        q.popleft()
    assert len(q) == 20_000 - 2_000 - 100
    live = sorted((r for r in rs if not r.status.is_finished), key=lambda r: (r.priority, r.arrival_time))
    assert q.head is live[100]


def test_the_policy_names_its_queue():
    assert type(create_request_queue("fcfs")) is WaitingQueue
    assert type(create_request_queue("priority")) is PriorityWaitingQueue
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        create_request_queue("lifo")
