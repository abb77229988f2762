"""What a scheduler step produces: the plan it scheduled, and the tokens it yielded.

`SchedulerOutput` is one scheduled step (`Scheduler.schedule`); `StepOutputs` is
what applying the worker's result gave (`Scheduler.update_from_output`): one new
token for each request that sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.worker_messages import StepPlan
from scheduler.sched.request import Request


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduled step: the plan for the worker, and what it means here."""

    plan: StepPlan
    # The requests scheduled, in batch order; each computes one token unless
    # plan.num_scheduled_tokens says otherwise (seq_id -> count).
    scheduled: list[Request]
    num_scheduled_tokens: int
    preempted: list[Request] = field(default_factory=list)
    # The requests whose computed tokens reach their token count this step, in batch
    # order: each samples exactly one token (the rows the result must name).
    sampling: list[Request] = field(default_factory=list)


@dataclass(slots=True)
class StepOutputs:
    """The tokens of one step, in columns: ``requests[i]`` got ``token_ids[i]``.

    NOTE: columns, not an object per request: a decode step makes no per-request
    object here (the step's cost grows with each per-request allocation).
    """

    # time.monotonic() when the tokens were applied.
    time: float
    requests: list[Request]
    token_ids: list[int]
    # Each request's previous token time, None when this is its first token.
    prev_token_times: list[float | None]
    # Index in `requests` -> finish reason, for the requests this step ended.
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def ttft_s(self, i: int) -> float | None:
        """Time to first token, when ``token_ids[i]`` is its request's first."""
        return self.time - self.requests[i].arrival_time if self.prev_token_times[i] is None else None
