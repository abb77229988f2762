"""The scheduling policy of vLLM v1, emitting delta plans for the worker.

Each step: running requests first (one token each when decoding, a chunk while
still prefilling), then waiting requests FCFS while the token budget
(max_num_batched_tokens) and max_num_seqs allow; a prompt may be split across
steps (chunked prefill). Out of blocks: preempt the last running request by
recompute. Finish on max_tokens or EOS (unless ignore_eos), or abort.

The worker keeps a copy of every running row, so the plan says only what changed
(DESIGN.md, the contract): rows are sent whole once (new, or resumed after a
preemption), then only grow by appended block ids; finished and preempted rows are
named by seq_id; a row decodes one token unless the plan says otherwise.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from protocol.worker_messages import AppendedBlocks, RequestRow, StepPlan, StepResult
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduled step: the plan for the worker, and what it means here."""

    plan: StepPlan
    # The requests scheduled, in batch order; each computes one token unless
    # plan.num_scheduled_tokens says otherwise (seq_id -> count).
    scheduled: list[Request]
    num_scheduled_tokens: int
    preempted: list[Request] = field(default_factory=list)
    # seq_ids of the rows whose computed tokens reach their token count this step:
    # each samples exactly one token (what the result must name).
    sampling_seq_ids: list[int] = field(default_factory=list)


class RequestOutput(msgspec.Struct, gc=False):
    """New tokens of one request after a step (or its end).

    A msgspec Struct, not a dataclass: one is made per running request per step,
    and a Struct's C __init__ is ~10x cheaper (~0.1 vs ~0.8 us, 256 a step).
    gc=False: it holds no cycle (a Request never points back at its outputs)."""

    request: Request
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    # Latencies this output completes (seconds): time to first token, or the gap
    # since the previous token.
    ttft_s: float | None = None
    itl_s: float | None = None


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Every unfinished request, by the client's id and by the wire's seq_id.
        self.requests: dict[str, Request] = {}
        self.seq_id_to_request: dict[int, Request] = {}
        self.next_step_id = 0
        # Rows the worker holds that must be dropped in the next plan.
        self._pending_finished_seq_ids: list[int] = []
        # seq_id -> number of block ids of that row the worker has been sent.
        self._num_sent_blocks: dict[int, int] = {}
        # The plan in flight: its results must be applied before the next schedule().
        self._in_flight: SchedulerOutput | None = None
        # Counters the process exports.
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    # --- requests ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request (see scheduler/validation.py) at the back."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.seq_id in self.seq_id_to_request:
            raise ValueError(f"duplicate seq_id {request.seq_id}")
        self.requests[request.request_id] = request
        self.seq_id_to_request[request.seq_id] = request
        # It stops at max_tokens, or when it fills max_model_len, whichever is first.
        request.max_num_tokens = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests early (abort, shutdown, client gone): free their blocks now;
        rows the worker holds are dropped in the next plan. Returns those ended."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus) -> None:
        was_on_worker = request.status == RequestStatus.RUNNING
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        del self.seq_id_to_request[request.seq_id]
        self._num_sent_blocks.pop(request.seq_id, None)
        if was_on_worker:
            self._pending_finished_seq_ids.append(request.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """Decide the next step. None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.plan.step_id} is still in flight")
        kv = self.kv_cache_manager
        token_budget = self.max_num_batched_tokens
        scheduled: list[Request] = []
        num_scheduled_tokens: dict[int, int] = {}
        appended: list[AppendedBlocks] = []
        preempted: list[Request] = []

        sampling: list[int] = []

        # 1. Running requests, in order.
        # NOTE: this loop runs once per running request per step (256 x ~50 steps/s);
        # it is written for speed: locals, no properties, and a fast path that skips
        # allocate_slots when it would do nothing (see below).
        running = self.running
        # NOTE: a preemption pops the end of `running`; the iterator sees it shorter.
        for request in running:
            if token_budget <= 0:
                break
            num_computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            num_new_tokens = num_tokens - num_computed
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            end = num_computed + num_new_tokens
            # NOTE: the common decode step skips this: allocate_slots keeps
            # request.kv_fast_until, below which it would allocate and cache nothing.
            if end > request.kv_fast_until:
                while True:
                    new_blocks = kv.allocate_slots(request, num_new_tokens)
                    if new_blocks is not None:
                        break
                    # Out of blocks: preempt the lowest-priority request (the last running).
                    victim = running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is request:
                        break
                if new_blocks is None:
                    break
                if new_blocks:
                    appended.append(AppendedBlocks(request.seq_id, [b.block_id for b in new_blocks]))
                    self._num_sent_blocks[request.seq_id] += len(new_blocks)
            scheduled.append(request)
            if num_new_tokens != 1:
                num_scheduled_tokens[request.seq_id] = num_new_tokens
            # NOTE: safe to count now: a preemption victim is always a request this
            # loop has not reached yet (the last running one), never a scheduled one.
            request.num_computed_tokens = end
            if end == num_tokens:
                sampling.append(request.seq_id)
            token_budget -= num_new_tokens
        # Running rows left out of this step (budget spent) must say so: default is 1.
        for request in self.running[len(scheduled) :]:
            num_scheduled_tokens[request.seq_id] = 0

        # 2. Waiting requests, FCFS, unless this step had to preempt.
        new_rows: list[RequestRow] = []
        resumed_rows: list[RequestRow] = []
        if not preempted:
            while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hits, num_hit_tokens = kv.get_computed_blocks(request, record_stats=False)
                num_new_tokens = min(request.num_tokens - num_hit_tokens, token_budget)
                new_blocks = kv.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
                if new_blocks is None:
                    break  # FCFS: nobody overtakes the head of the queue
                kv.record_prefix_cache_query(request.num_tokens, num_hit_tokens)
                self.waiting.popleft()
                self.running.append(request)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit_tokens
                block_ids = kv.get_block_ids(request.request_id)
                row = RequestRow(request.seq_id, list(request.all_token_ids), block_ids, num_hit_tokens)
                (resumed_rows if request.status == RequestStatus.PREEMPTED else new_rows).append(row)
                request.status = RequestStatus.RUNNING
                self._num_sent_blocks[request.seq_id] = len(block_ids)
                scheduled.append(request)
                if num_new_tokens != 1:
                    num_scheduled_tokens[request.seq_id] = num_new_tokens
                request.num_computed_tokens = num_hit_tokens + num_new_tokens
                if request.num_computed_tokens == request.num_tokens:
                    sampling.append(request.seq_id)
                token_budget -= num_new_tokens

        finished_seq_ids = self._pending_finished_seq_ids
        self._pending_finished_seq_ids = []
        if not scheduled:
            # Nothing to run; rows to drop ride along with the next plan.
            self._pending_finished_seq_ids = finished_seq_ids
            self._pending_finished_seq_ids.extend(r.seq_id for r in preempted)
            return None

        plan = StepPlan(
            step_id=self.next_step_id,
            num_scheduled_tokens=num_scheduled_tokens,
            new_rows=new_rows,
            resumed_rows=resumed_rows,
            appended=appended,
            finished_seq_ids=finished_seq_ids,
            preempted_seq_ids=[r.seq_id for r in preempted],
        )
        self.next_step_id += 1
        total = self.max_num_batched_tokens - token_budget
        self._in_flight = SchedulerOutput(plan, scheduled, total, preempted, sampling)
        return self._in_flight

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: free its blocks (deepest first), computed tokens
        back to 0, front of the waiting queue. Its prefix may still hit the cache."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_sent_blocks.pop(request.seq_id, None)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def preempt_all(self) -> None:
        """The worker is gone with every row: all running requests go back to the
        front of the waiting queue, in order, to be recomputed."""
        for request in reversed(self.running):
            self._preempt(request)
        self.running.clear()
        self._pending_finished_seq_ids.clear()

    def update_from_output(self, result: StepResult) -> list[RequestOutput]:
        """Apply the worker's result of the plan in flight: append sampled tokens,
        stop requests that are done. Raises ValueError on a result that does not
        match the plan (nothing applied then)."""
        out = self._in_flight
        if out is None or result.step_id != out.plan.step_id:
            expected = None if out is None else out.plan.step_id
            raise ValueError(f"result for step {result.step_id}, expected {expected}")
        if len(result.seq_ids) != len(result.sampled_token_ids):
            raise ValueError("result has different numbers of seq_ids and sampled tokens")
        # Rows that completed their tokens this step sample exactly one token each.
        # NOTE: the list compare is the cheap common case (the worker answers in plan
        # order); the sets decide when it does not.
        if result.seq_ids != out.sampling_seq_ids:
            got, expects = set(result.seq_ids), set(out.sampling_seq_ids)
            if got != expects or len(got) != len(result.seq_ids):
                raise ValueError(f"step {result.step_id}: sampled rows {sorted(got)} but expected {sorted(expects)}")
        self._in_flight = None

        # NOTE: once per sampled row per step: locals, no properties (see schedule()).
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        seq_id_to_request = self.seq_id_to_request
        num_generated = 0
        block_size = self.block_size
        for seq_id, token_id in zip(result.seq_ids, result.sampled_token_ids, strict=True):
            request = seq_id_to_request.get(seq_id)
            if request is None:
                continue  # ended (aborted) while the step ran
            # NOTE: Request.append_output_token_id, inlined.
            all_token_ids = request.all_token_ids
            all_token_ids.append(token_id)
            num_tokens = len(all_token_ids)
            if not num_tokens % block_size and request.block_hasher is not None:
                request.block_hasher.extend_block_hashes(request.block_hashes, all_token_ids, request.cache_salt)
            num_generated += 1
            if request.first_token_time is None:
                request.first_token_time = now
                ttft_s, itl_s = now - request.arrival_time, None
                # As vLLM counts it: the whole prompt, cached tokens included, once.
                self.num_prompt_tokens += request.num_prompt_tokens
            else:
                ttft_s, itl_s = None, now - request.last_token_time
            request.last_token_time = now
            if num_tokens < request.max_num_tokens and token_id != request.stop_token_id:
                outputs.append(RequestOutput(request, [token_id], False, None, ttft_s, itl_s))
                continue
            status = RequestStatus.FINISHED_STOPPED if num_tokens < request.max_num_tokens else RequestStatus.FINISHED_LENGTH
            self.running.remove(request)
            self._finish(request, status)
            outputs.append(RequestOutput(request, [token_id], True, status.value, ttft_s, itl_s))
        self.num_generation_tokens += num_generated
        return outputs

    def abandon_in_flight(self) -> SchedulerOutput | None:
        """The worker is gone: forget the plan in flight (its tokens were not produced)."""
        out, self._in_flight = self._in_flight, None
        if out is not None:
            counts = out.plan.num_scheduled_tokens
            for request in out.scheduled:
                if request.status == RequestStatus.RUNNING:
                    request.num_computed_tokens -= counts.get(request.seq_id, 1)
        return out
