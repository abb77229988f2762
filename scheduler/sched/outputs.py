"""What a scheduler step produces: the plan it scheduled, and the tokens it yielded.

`SchedulerOutput` is one scheduled step (`Scheduler.schedule`); `StepTokens` is
what applying the worker's result gave (`Scheduler.update_from_output`): one new
token for each request that sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter

from protocol.worker_messages import StepPlan, StepResult
from scheduler.sched.request import Request

_SEQ_ID = attrgetter("seq_id")


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

    def match_result(self, result: StepResult) -> list[Request]:
        """The requests of the worker's ``result`` of this step, in its row order.
        Raises ValueError unless it names exactly the rows that sample, one token each."""
        if result.step_id != self.plan.step_id:
            raise ValueError(f"result for step {result.step_id}, expected {self.plan.step_id}")
        if len(result.seq_ids) != len(result.sampled_token_ids):
            raise ValueError("result has different numbers of seq_ids and sampled tokens")
        # NOTE: the list compare is the cheap common case (the worker answers in plan
        # order); otherwise the rows are matched by seq_id.
        requests = self.sampling
        expected_ids = list(map(_SEQ_ID, requests))
        if result.seq_ids != expected_ids:
            got = set(result.seq_ids)
            if got != set(expected_ids) or len(got) != len(result.seq_ids):
                raise ValueError(f"step {result.step_id}: sampled rows {sorted(got)} but expected {sorted(expected_ids)}")
            by_seq_id = {r.seq_id: r for r in requests}
            requests = [by_seq_id[seq_id] for seq_id in result.seq_ids]
        if result.extra_token_ids:
            self._check_extra_tokens(result)
        return requests

    def _check_extra_tokens(self, result: StepResult) -> None:
        """A row's tokens after its first must follow accepted drafts: its first token and
        all but the last extra one equal its drafts, in order, and no more than it had."""
        spec = self.plan.spec_token_ids
        first_of = dict(zip(result.seq_ids, result.sampled_token_ids, strict=True))
        for seq_id, more in result.extra_token_ids.items():
            drafts = spec.get(seq_id)
            if drafts is None or not more or len(more) > len(drafts):
                raise ValueError(f"step {result.step_id}: seq {seq_id} has {len(more)} extra tokens for {len(drafts or ())} drafts")
            first = first_of[seq_id]
            if [first, *more[:-1]] != drafts[: len(more)]:
                raise ValueError(f"step {result.step_id}: seq {seq_id}'s tokens {[first, *more]} do not follow its drafts {drafts}")


@dataclass(slots=True)
class StepTokens:
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
    # Index in `requests` -> the tokens it got after ``token_ids[i]`` (speculative decoding:
    # accepted drafts and the token after them), only as many as it kept (a stop ends them).
    more_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Every token of the step (vLLM's num_generation_tokens)."""
        n = len(self.requests)
        for more in self.more_token_ids.values():
            n += len(more)
        return n

    def new_token_ids(self, i: int) -> list[int]:
        """All the tokens ``requests[i]`` got this step, in order."""
        more = self.more_token_ids.get(i)
        return [self.token_ids[i]] if more is None else [self.token_ids[i], *more]

    def ttft_s(self, i: int) -> float | None:
        """Time to first token, when ``token_ids[i]`` is its request's first."""
        return self.time - self.requests[i].arrival_time if self.prev_token_times[i] is None else None

    def without(self, skipped: list[int]) -> StepTokens:
        """These outputs less the rows at the indices ``skipped`` (ascending)."""
        keep = sorted(set(range(len(self.requests))) - set(skipped))
        position = {old: new for new, old in enumerate(keep)}
        return StepTokens(
            self.time,
            [self.requests[i] for i in keep],
            [self.token_ids[i] for i in keep],
            [self.prev_token_times[i] for i in keep],
            {position[i]: reason for i, reason in self.finish_reasons.items()},
            {position[i]: more for i, more in self.more_token_ids.items() if i in position},
        )
