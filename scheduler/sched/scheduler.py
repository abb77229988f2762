"""The scheduling policy of vLLM v1, emitting delta plans for the worker.

Each step: running requests first (one token each when decoding, a chunk while still
prefilling), then waiting requests FCFS while the token budget and max_num_active_seqs allow; a
prompt may be split across steps (chunked prefill, unless off; the budget, --watermark:
scheduler/sched/policy_options.py). Out of blocks: preempt the last running request by
recompute (priority: scheduler/sched/priority_scheduler.py). Finish on max_tokens, or on
a stop token (EOS unless ignore_eos, and stop_token_ids) once min_tokens are out.

Speculative decoding (``speculative``, vLLM's --speculative-config): after each step the
requests that sampled get drafts, n-gram or suffix decoding's (scheduler/spec/proposer.py:
the drafter hears too of requests that leave the batch or end); a decoding
request is then scheduled 1 + its drafts, their slots allocated with its tokens (only
verified tokens are ever cached); the worker's result says how many were accepted, and
the rejected ones come off its computed tokens (scheduler/sched/sampled_tokens.py).

The plan says only what changed since the last (scheduler/sched/plan_builder.py); the
worker's sampled tokens are appended by scheduler/sched/sampled_tokens.py."""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial

from protocol.speculative_config import SpeculativeConfig
from protocol.worker_messages import StepResult
from scheduler.core.kv_cache_blocks import NO_NEW_BLOCKS, KVCacheBlocks
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.external_wait import ExternalKVWait
from scheduler.sched.grammar_wait import GrammarWait
from scheduler.sched.outputs import SchedulerOutput, StepTokens
from scheduler.sched.pd_connector import PDConnector
from scheduler.sched.plan_builder import StepPlanBuilder
from scheduler.sched.policy_options import check_scheduler_options, long_prefill_cap, step_budget
from scheduler.sched.prompt_token_stats import PromptTokenStats
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.request_queue import create_request_queue
from scheduler.sched.sampled_tokens import append_sampled_tokens
from scheduler.sched.worker_loss import WorkerLossRecovery
from scheduler.spec.proposer import make_proposer
from scheduler.spec.spec_stats import SpecDecodingStats

# How a request ends when a prefill engine lends its blocks: normally (vLLM's connector frees an aborted one's).
_LENDS = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)


class Scheduler(WorkerLossRecovery, GrammarWait, ExternalKVWait):
    policy = "fcfs"  # --scheduling-policy (its waiting queue: scheduler/sched/request_queue.py)

    def __init__(self, kv_cache_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 reserve_full_sequence: bool = True, *, long_prefill_token_threshold: int = 0,
                 long_prefill_token_threshold_adaptive: bool = False, enable_chunked_prefill: bool = True, watermark: float = 0.0,
                 max_num_scheduled_tokens: int | None = None, max_num_active_seqs: int | None = None,
                 speculative: SpeculativeConfig | None = None, kv_transfer: PDConnector | None = None):
        check_scheduler_options(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                long_prefill_token_threshold=long_prefill_token_threshold, watermark=watermark,
                                max_num_scheduled_tokens=max_num_scheduled_tokens, max_num_active_seqs=max_num_active_seqs)
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens  # NOTE: admission: max_num_active_seqs
        self.max_num_active_seqs = max_num_seqs if max_num_active_seqs is None else max_num_active_seqs  # vLLM's max_num_active_reqs
        self.max_num_scheduled_tokens = max_num_scheduled_tokens  # None: the step's budget is max_num_batched_tokens
        self.watermark_blocks = int(watermark * kv_cache_manager.block_pool.num_gpu_blocks)  # vLLM's: free blocks an admission leaves (others running)
        self.max_model_len = max_model_len
        # vLLM 0.32's scheduler_reserve_full_isl (its default, on): a waiting request is admitted only if
        # the pool could hold its whole sequence, not just its first chunk (none admitted to be preempted).
        self.reserve_full_sequence = reserve_full_sequence
        # The step's cap on one request's tokens, from the number running and waiting (None: off).
        self._long_prefill_cap = partial(long_prefill_cap, long_prefill_token_threshold, long_prefill_token_threshold_adaptive, max_num_batched_tokens) if long_prefill_token_threshold else None
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Every unfinished request, by the client's id and by the wire's seq_id.
        self.requests: dict[str, Request] = {}
        self.seq_id_to_request: dict[int, Request] = {}
        self.next_step_id = 0
        # Rows the worker holds that must be dropped in the next plan.
        self._pending_finished_seq_ids: list[int] = []
        # The plan in flight: its results must be applied before the next schedule().
        self._in_flight: SchedulerOutput | None = None
        # Counters the process exports; a lost worker's requests, sent back to be recomputed, are not preemptions.
        self.num_preemptions = 0
        self.num_worker_loss_recomputes = 0
        self.prompt_token_stats = PromptTokenStats()
        self.num_generation_tokens = 0
        # Speculative decoding: the drafter and vLLM's spec-decode counters (None: off).
        self.speculative = speculative
        self.proposer = None if speculative is None else make_proposer(speculative, max_model_len)
        self.spec_stats = None if speculative is None else SpecDecodingStats(speculative.num_speculative_tokens)
        # P/D disaggregation's connector (scheduler/sched/pd_connector.py; None: off).
        self.kv_transfer = kv_transfer
        if kv_transfer is not None and kv_transfer.config.is_consumer:
            kv_cache_manager.has_connector = True
        self._init_grammar_wait()
        self._init_external_wait()

    # --- requests ---------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request (see scheduler/sched/validation.py) at the back."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.seq_id in self.seq_id_to_request:
            raise ValueError(f"duplicate seq_id {request.seq_id}")
        if self.kv_transfer is not None and request.request_id in self.kv_transfer.lent:
            raise ValueError(f"duplicate request id {request.request_id!r} (its blocks are lent to a decode engine)")
        self.requests[request.request_id] = self.seq_id_to_request[request.seq_id] = request
        # It stops at max_tokens, or when it fills max_model_len, whichever is first.
        request.max_num_tokens = min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        if request.grammar is not None:
            self._wait_for_grammar(request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests early (abort, shutdown, client gone): free their blocks now;
        rows the worker holds are dropped in the next plan. Returns those ended."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
                del self.waiting_for_grammar[request.seq_id]
                self._finish(request, status)
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self._end_loading(request, status)
            elif self._finish(request, status):
                self.running.remove(request)
            else:
                self.waiting.remove_ended(request)
            ended.append(request)
        return ended

    def _finish(self, request: Request, status: RequestStatus) -> bool:
        was_on_worker = request.status == RequestStatus.RUNNING
        request.status = status
        request.append_only_below = 0
        if status in _LENDS and self.kv_transfer is not None and self.kv_transfer.wants_lend(request):
            # A prefill engine's request: its blocks, in every KV-cache group, wait for a decode engine (pd_connector.py).
            request.kv_transfer_answer = self.kv_transfer.lend(request, self.kv_cache_manager.get_block_ids(request.request_id))
        else:
            self.kv_cache_manager.free(request)
        if self.proposer is not None:
            self.proposer.finish(request)
        del self.requests[request.request_id]
        del self.seq_id_to_request[request.seq_id]
        if was_on_worker:
            self._pending_finished_seq_ids.append(request.seq_id)
        return was_on_worker  # its row is dropped in the next plan

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def step_token_budget(self) -> int:  # NOTE: read afresh by every schedule()
        return step_budget(self.max_num_batched_tokens, self.max_num_scheduled_tokens)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.waiting_for_grammar) + len(self.loading)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step ---------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput | None:
        """Decide the next step. None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.plan.step_id} is still in flight")
        preempted: list[Request] = []
        while True:
            plan = StepPlanBuilder()
            cap = self._long_prefill_cap(len(self.running) + len(self.waiting)) if self._long_prefill_cap else 0
            token_budget, scheduled, sampling, victims = self._schedule_running(plan, cap)
            if not victims:
                if self.waiting:  # waiting requests only if this step did not have to preempt
                    token_budget = self._schedule_waiting(plan, token_budget, scheduled, sampling, cap)
                break
            preempted += victims
            if scheduled:  # NOTE: else the first running one preempted itself: vLLM runs an empty step, we plan again
                break
        external = self.kv_cache_manager.take_external_ops()
        kv_transfer = None if self.kv_transfer is None else self.kv_transfer.take_ops()
        if not scheduled and external is None and kv_transfer is None:
            # Nothing to run; rows to drop ride along with the next plan.
            self._pending_finished_seq_ids.extend(r.seq_id for r in preempted)
            return None
        # NOTE: a plan of external saves or loads alone runs too: a parked request's load starts, blocks of the last step are saved.
        finished_seq_ids, self._pending_finished_seq_ids = self._pending_finished_seq_ids, []
        nulled = self._nulled_rows()
        step_plan = plan.build(self.next_step_id, finished_seq_ids, preempted, self.kv_cache_manager.take_tier_copies(), nulled, external,
                               kv_transfer)
        self.next_step_id += 1
        total = self.step_token_budget - token_budget
        self._in_flight = SchedulerOutput(step_plan, scheduled, total, preempted, sampling)
        return self._in_flight

    def _nulled_rows(self) -> list[tuple[int, int, int]]:
        """(seq_id, group, leading null entries) of the running rows whose sliding windows freed blocks."""
        nulled = self.kv_cache_manager.take_nulled()
        if not nulled:
            return []
        requests = self.requests
        out = []
        for request_id, group, num_blocks in nulled:
            request = requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                out.append((request.seq_id, group, num_blocks))
        return out

    def _schedule_running(self, plan: StepPlanBuilder, cap: int) -> tuple[int, list[Request], list[Request], list[Request]]:
        """Schedule the running requests, in order, while the token budget lasts, at
        most ``cap`` tokens each (0: no cap). Returns the budget left, the requests
        scheduled, those of them sampling (their computed tokens reach their token
        count), and the requests preempted."""
        token_budget = self.step_token_budget
        num_scheduled_tokens = plan.num_scheduled_tokens
        preempted: list[Request] = []
        # NOTE: this loop runs once per running request per step; it is written for speed.
        # The common case, one decode token with room in the request's blocks and nothing
        # to cache (request.alloc_noop_until, kept by the KV cache manager), only counts
        # the token; the batch lists are made after the loop, at C speed.
        running = self.running
        num_scheduled_running = -1  # -1: every request left in `running`
        all_sampling = True  # every scheduled running request completes its tokens
        # NOTE: a preemption pops the end of `running`; the iterator sees it shorter.
        for request in running:
            num_computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            num_new_tokens = num_tokens - num_computed
            drafts = request.spec_token_ids
            if drafts:
                num_new_tokens += len(drafts)
            elif num_new_tokens == 1 and num_computed < request.alloc_noop_until and token_budget > 0:
                request.num_computed_tokens = num_tokens
                token_budget -= 1
                continue
            if token_budget <= 0:
                num_scheduled_running = running.index(request)
                break
            if 0 < cap < num_new_tokens:
                num_new_tokens = cap
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            end = num_computed + num_new_tokens
            if end > request.alloc_noop_until:
                new_blocks = self._allocate_or_preempt(request, num_new_tokens, preempted)
                if new_blocks is None:
                    break  # it preempted itself: the requests before it are scheduled
                if new_blocks is not NO_NEW_BLOCKS:
                    plan.append_blocks(request.seq_id, new_blocks)
            if drafts:
                plan_drafts(plan, request, end - num_tokens)
            if num_new_tokens != 1:
                num_scheduled_tokens[request.seq_id] = num_new_tokens
            # NOTE: safe to count now: a preemption victim is always a request this
            # loop has not reached yet (the last running one), never a scheduled one.
            request.num_computed_tokens = end
            if end < num_tokens:
                all_sampling = False
            token_budget -= num_new_tokens
        if num_scheduled_running < 0:
            scheduled = running.copy()
        else:
            scheduled = running[:num_scheduled_running]
            # Running rows left out of this step (budget spent) must say so: default is 1.
            for request in running[num_scheduled_running:]:
                num_scheduled_tokens[request.seq_id] = 0
                if self.proposer is not None:
                    self.proposer.stop(request)  # NOTE: as vLLM's runner, out of its batch
        sampling = scheduled.copy() if all_sampling else [r for r in scheduled if r.num_computed_tokens >= len(r.all_token_ids)]
        return token_budget, scheduled, sampling, preempted

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, preempted: list[Request]) -> KVCacheBlocks | None:
        """Room for ``num_new_tokens`` more tokens of a running request: its new blocks. Out
        of blocks, preempt the last running request and retry; None once it was this one."""
        kv = self.kv_cache_manager
        running = self.running
        while True:
            if num_new_tokens == 1:
                new_blocks = kv.allocate_next_slot(request)
            else:
                new_blocks = kv.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None

    def _schedule_waiting(self, plan: StepPlanBuilder, token_budget: int, scheduled: list[Request], sampling: list[Request], cap: int) -> int:
        """Admit waiting requests from the head while the budget, max_num_active_seqs and the pool allow, at most ``cap``
        tokens each (0: none; unsplit without chunked prefill); each joins ``scheduled`` (``sampling`` if done)."""
        kv = self.kv_cache_manager
        waiting, running = self.waiting, self.running
        num_scheduled_tokens = plan.num_scheduled_tokens
        now = time.monotonic()
        while waiting and token_budget > 0 and len(running) < self.max_num_active_seqs:
            request = waiting.head
            loaded = self.loads_external and self._holds_loaded_blocks(request)
            if loaded:
                # Its blocks were loaded (the external tier, a prefill engine): held and cached, counted at its park.
                hits, num_hit_tokens = None, request.num_computed_tokens
            else:
                hits, num_hit_tokens = kv.get_computed_blocks(request, record_stats=False)
                num_external_tokens, pull = self._external_tokens(request, num_hit_tokens)
                if num_external_tokens:
                    if not self._park_for_load(request, hits, num_hit_tokens, num_external_tokens, pull):
                        break  # nobody overtakes the head of the queue
                    continue
            num_new_tokens = request.num_tokens - num_hit_tokens
            if 0 < cap < num_new_tokens:
                num_new_tokens = cap
            if num_new_tokens > token_budget:
                if not self.enable_chunked_prefill:
                    break  # vLLM: not split, and nobody overtakes the head
                num_new_tokens = token_budget
            # NOTE: a loaded request's computed tokens are its own already, not new hits.
            new_blocks = kv.allocate_slots(request, num_new_tokens, 0 if loaded else num_hit_tokens, hits, full_sequence_must_fit=self.reserve_full_sequence,
                                           watermark_blocks=self.watermark_blocks if running else 0)
            if new_blocks is None:
                if not running and self._release_loaded_behind(request):
                    continue  # NOTE: nothing runs to free blocks; loaded ones behind the head were holding them
                break  # nobody overtakes the head of the queue
            # NOTE: admitted before (resumed after a preemption or a lost worker): counted apart.
            num_host_hit_tokens = request.num_external_cached_tokens if loaded else num_hit_tokens - len(hits) * self.block_size
            if not loaded and kv.prefix_cache_lookup_enabled(request):  # NOTE: vLLM counts no lookup of a request that skips the cache
                kv.record_prefix_cache_query(request.num_tokens, num_hit_tokens, request.num_cached_tokens >= 0, num_host_hit_tokens)
            waiting.popleft()
            running.append(request)
            if request.num_cached_tokens < 0:
                # As vLLM's SCHEDULED event and PrefillStats: the first admission only.
                request.scheduled_time = now
                request.num_cached_tokens = num_hit_tokens
                request.num_external_cached_tokens = num_host_hit_tokens
            plan.add_row(request, kv.get_block_ids(request.request_id), num_hit_tokens, request.status == RequestStatus.PREEMPTED)
            request.status = RequestStatus.RUNNING
            scheduled.append(request)
            if num_new_tokens != 1:
                num_scheduled_tokens[request.seq_id] = num_new_tokens
            request.num_computed_tokens = num_hit_tokens + num_new_tokens
            if request.num_computed_tokens == request.num_tokens:
                sampling.append(request)
            token_budget -= num_new_tokens
        return token_budget

    def _preempt(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Preemption by recompute (vllm:num_preemptions); see `_requeue`."""
        self._requeue(request, num_computed_tokens)
        request.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Free its blocks (deepest first; ``num_computed_tokens``: see KVCacheManager.free),
        computed tokens back to 0, front of the waiting queue; its prefix may still hit."""
        self.kv_cache_manager.free(request, num_computed_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()  # as vLLM: drafts go with the blocks; a resumed request drafts afresh
        if self.proposer is not None:
            self.proposer.stop(request)
        request.prompt_logprobs = None  # NOTE: the worker scores its prompt afresh, from position 0
        self.waiting.appendleft(request)

    def update_from_output(self, result: StepResult) -> StepTokens:
        """Apply the worker's result of the plan in flight: append sampled tokens,
        stop requests that are done (scheduler/sched/sampled_tokens.py). Raises
        ValueError on a result that does not match the plan (nothing applied then)."""
        out = self._in_flight
        if out is None:
            raise ValueError(f"result for step {result.step_id}, expected None")
        requests = out.match_result(result)
        self._in_flight = None
        if out.plan.tier_copies is not None:
            self.kv_cache_manager.complete_tier_copies()
        spec = out.plan.spec_token_ids
        if spec:
            self._roll_back_rejected(requests, result, spec)
        outputs, done = append_sampled_tokens(requests, result.sampled_token_ids, self.block_size, self.prompt_token_stats,
                                              result.extra_token_ids)
        for request, status in done:
            self.running.remove(request)
            self._finish(request, status)
        self.num_generation_tokens += outputs.num_tokens
        if self.proposer is not None:
            self._draft(outputs.requests)
        return outputs

    def _roll_back_rejected(self, requests: list[Request], result: StepResult, spec: dict[int, list[int]]) -> None:
        """The drafts the worker rejected come off their requests' computed tokens (their
        slots stay in the table, for the next tokens); vLLM's spec-decode counters."""
        extra = result.extra_token_ids
        stats = self.spec_stats
        for request in requests:
            drafts = spec.get(request.seq_id)
            if drafts is None:
                continue
            request.spec_token_ids.clear()
            if request.status is not RequestStatus.RUNNING:
                continue  # ended (aborted) while the step ran: nothing to roll back
            # Its first token is its first draft when that was accepted; each further token follows
            # an accepted draft (SchedulerOutput.match_result checked them against the drafts).
            more = extra.get(request.seq_id)
            num_accepted = 0 if more is None else len(more)
            request.num_computed_tokens -= len(drafts) - num_accepted
            stats.observe_draft(len(drafts), num_accepted)

    def _draft(self, requests: list[Request]) -> None:
        """Drafts for the next step of the requests that just sampled and still run."""
        propose = self.proposer.propose
        for request in requests:
            if request.status is RequestStatus.RUNNING and request.num_computed_tokens == len(request.all_token_ids) - 1:
                request.spec_token_ids = propose(request)


def plan_drafts(plan: StepPlanBuilder, request: Request, num_drafts: int) -> None:
    """The first ``num_drafts`` of the request's drafts go into the plan; as vLLM, those
    past what the step's budget allowed are dropped, not kept for a later step."""
    drafts = request.spec_token_ids
    if num_drafts <= 0:
        drafts.clear()
    else:
        del drafts[num_drafts:]
        plan.spec_token_ids[request.seq_id] = drafts.copy()
