"""What the scheduler does when the worker is gone with every row (docs/operations.md,
"A worker dies"): the plan in flight is forgotten, and every running request goes back
to the waiting queue to be recomputed -- not a preemption, the policy chose none.

A mixin of `Scheduler` (scheduler/sched/scheduler.py), over its running list, its
waiting queue and the plan in flight.
"""

from __future__ import annotations

from scheduler.sched.outputs import SchedulerOutput
from scheduler.sched.request import RequestStatus


class WorkerLossRecovery:
    def abandon_in_flight(self) -> SchedulerOutput | None:
        """The worker is gone: forget the plan in flight (its tokens were not produced)."""
        out, self._in_flight = self._in_flight, None
        if out is not None:
            counts = out.plan.num_scheduled_tokens
            for request in out.scheduled:
                if request.status == RequestStatus.RUNNING:
                    request.num_computed_tokens -= counts.get(request.seq_id, 1)
        return out

    def preempt_all(self) -> None:
        """The worker is gone with every row: all running requests go back to the
        front of the waiting queue, in order, to be recomputed. Not preemptions (the
        policy chose none): counted in num_worker_loss_recomputes."""
        for request in reversed(self.running):
            self._requeue(request)
        self.num_worker_loss_recomputes += len(self.running)
        self.running.clear()
        self._pending_finished_seq_ids.clear()
