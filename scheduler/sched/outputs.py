"""What a scheduler step produces: the plan it scheduled, and the tokens it yielded.

`SchedulerOutput` is one scheduled step (`Scheduler.schedule`); `StepOutputs` is
what applying the worker's result gave (`Scheduler.update_from_output`): one new
token for each request that sampled. `RequestOutput` is one request's row of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import msgspec

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


class RequestOutput(msgspec.Struct, gc=False):
    """New tokens of one request after a step (or its end).

    gc=False: it holds no cycle (a Request never points back at its outputs)."""

    request: Request
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    # Latencies this output completes (seconds): time to first token, or the gap
    # since the previous token.
    ttft_s: float | None = None
    itl_s: float | None = None


@dataclass(slots=True)
class StepOutputs:
    """The tokens of one step, in columns: ``requests[i]`` got ``token_ids[i]``.

    NOTE: columns, not an object per request: a decode step of 256 requests makes
    no per-request object here (that was a third of the step's cost). Iterating
    gives each request's `RequestOutput`, made on demand, for callers that want rows.
    """

    # time.monotonic() when the tokens were applied.
    time: float
    requests: list[Request]
    token_ids: list[int]
    # Each request's previous token time, None when this is its first token.
    prev_token_times: list[float | None]
    # Index in `requests` -> finish reason, for the requests this step ended.
    finish_reasons: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def ttft_s(self, i: int) -> float | None:
        """Time to first token, when ``token_ids[i]`` is its request's first."""
        return self.time - self.requests[i].arrival_time if self.prev_token_times[i] is None else None

    def itl_s(self, i: int) -> float | None:
        """The gap since the request's previous token (None for a first token)."""
        prev = self.prev_token_times[i]
        return None if prev is None else self.time - prev

    def output(self, i: int) -> RequestOutput:
        reason = self.finish_reasons.get(i)
        return RequestOutput(
            self.requests[i], [self.token_ids[i]], reason is not None, reason, self.ttft_s(i), self.itl_s(i)
        )

    def __iter__(self) -> Iterator[RequestOutput]:
        return map(self.output, range(len(self.requests)))
