"""The waiting queue: first come, first served (vLLM's ``FCFSRequestQueue``), or by
priority (``PriorityWaitingQueue``, vLLM's ``PriorityRequestQueue``), with ends in
O(1) (a heap: O(log n)) wherever the request stands.

Requests join at the back (`append`), preempted ones go back to the front
(`appendleft`), and the scheduler admits from the head (`head`, `popleft`). A request
that ends while waiting (an abort, a client gone) is popped if it stands at either
end; elsewhere it stays in place, already finished, and is dropped when it reaches
the head, or when the ended outnumber the waiting and the queue is rebuilt in one
pass. NOTE: ``deque.remove`` is a scan: a client aborting its thousands of requests
one by one at the back of a long queue held the loop for seconds.

Invariant: the head is a request that still waits, so the queue is non-empty exactly
when some request waits; ``len`` counts those that wait.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from scheduler.sched.request import Request

# Ended requests left in place are dropped in one pass once there are more than this
# many and more than there are requests still waiting.
MIN_ENDED_TO_REBUILD = 64


class WaitingQueue:
    __slots__ = ("_queue", "_num_ended")

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self._num_ended = 0  # finished requests still in _queue

    def __len__(self) -> int:
        return len(self._queue) - self._num_ended

    def __bool__(self) -> bool:
        return bool(self._queue)  # the head waits: non-empty means someone waits

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, front to back."""
        return (r for r in self._queue if not r.status.is_finished)

    def __contains__(self, request: Request) -> bool:
        return not request.status.is_finished and request in self._queue

    @property
    def head(self) -> Request:
        """The first waiting request (IndexError when none waits)."""
        return self._queue[0]

    def append(self, request: Request) -> None:
        self._queue.append(request)

    def appendleft(self, request: Request) -> None:
        self._queue.appendleft(request)

    def popleft(self) -> Request:
        request = self._queue.popleft()
        self._drop_ended_head()
        return request

    def remove_ended(self, request: Request) -> None:
        """Take ``request``, which has just ended (its status is finished), out of the
        queue in O(1) amortized."""
        queue = self._queue
        if queue[-1] is request:
            queue.pop()
        elif queue[0] is request:
            queue.popleft()
            self._drop_ended_head()
        else:
            self._num_ended += 1
            if self._num_ended > MIN_ENDED_TO_REBUILD and 2 * self._num_ended > len(queue):
                live = [r for r in queue if not r.status.is_finished]
                queue.clear()
                queue.extend(live)
                self._num_ended = 0

    def _drop_ended_head(self) -> None:
        queue = self._queue
        while self._num_ended and queue and queue[0].status.is_finished:
            queue.popleft()
            self._num_ended -= 1


class PriorityWaitingQueue:
    """vLLM's ``PriorityRequestQueue``: a heap by (priority, arrival_time), lower
    first; equal ones by request_id (as vLLM's ``Request.__lt__``), then by the
    order they were pushed (vLLM: by ``id()``, an arbitrary order). A preempted
    request goes back in by the same key: a heap has no front to put it at.

    The same interface and lazy deletion as `WaitingQueue`: a request ending while
    waiting is popped if it is the head; elsewhere it stays in the heap, already
    finished, until it reaches the head or the ended outnumber the waiting and the
    heap is rebuilt. NOTE: vLLM's ``heap.remove`` + ``heapify`` is O(n) an abort.
    """

    __slots__ = ("_heap", "_num_ended", "_counter")

    def __init__(self) -> None:
        # (priority, arrival_time, request_id, push order, request): the push order
        # is unique, so the request itself is never compared.
        self._heap: list[tuple[int, float, str, int, Request]] = []
        self._num_ended = 0  # finished requests still in _heap
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._heap) - self._num_ended

    def __bool__(self) -> bool:
        return bool(self._heap)  # the head waits: non-empty means someone waits

    def __iter__(self) -> Iterator[Request]:
        """The waiting requests, in the order they would be admitted."""
        return (e[-1] for e in sorted(self._heap) if not e[-1].status.is_finished)

    def __contains__(self, request: Request) -> bool:
        return not request.status.is_finished and any(e[-1] is request for e in self._heap)

    @property
    def head(self) -> Request:
        """The waiting request with the lowest (priority, arrival_time) (IndexError when none waits)."""
        return self._heap[0][-1]

    def append(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.request_id, next(self._counter), request))

    appendleft = append  # a preempted request: back in by its key

    def popleft(self) -> Request:
        request = heapq.heappop(self._heap)[-1]
        self._drop_ended_head()
        return request

    def remove_ended(self, request: Request) -> None:
        """Take ``request``, which has just ended (its status is finished), out of the
        queue in O(log n) amortized."""
        heap = self._heap
        if heap[0][-1] is request:
            heapq.heappop(heap)
            self._drop_ended_head()
            return
        self._num_ended += 1
        if self._num_ended > MIN_ENDED_TO_REBUILD and 2 * self._num_ended > len(heap):
            heap[:] = [e for e in heap if not e[-1].status.is_finished]
            heapq.heapify(heap)
            self._num_ended = 0

    def _drop_ended_head(self) -> None:
        heap = self._heap
        while self._num_ended and heap and heap[0][-1].status.is_finished:
            heapq.heappop(heap)
            self._num_ended -= 1


def create_request_queue(policy: str) -> WaitingQueue | PriorityWaitingQueue:
    """The waiting queue of ``--scheduling-policy`` ``policy`` ("fcfs" or "priority")."""
    if policy == "fcfs":
        return WaitingQueue()
    if policy == "priority":
        return PriorityWaitingQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}: expected 'fcfs' or 'priority'")
