"""``--scheduling-policy priority``: vLLM 0.32's ``SchedulingPolicy.PRIORITY``.

Two things differ from FCFS (scheduler/sched/scheduler.py), as in vLLM:

* the waiting queue is a heap by (priority, arrival_time), lower first
  (`PriorityWaitingQueue`); admission takes its head, a victim goes back in by its key;
* out of blocks, the victim is the running request with the largest (priority,
  arrival_time), the lowest priority and latest arrival, first found in `running`
  order among equals (vLLM's ``max``), wherever it stands: one already scheduled in
  this step is taken out of it (its tokens back to the budget, its row out of the plan).

As in vLLM 0.32, a waiting request never preempts a running one, whatever its
priority: only a running request that needs blocks preempts.

NOTE: a victim scheduled earlier in the step had its blocks cached, at scheduling
time, for tokens the step will now not compute; they lose their hash as it is freed
(`KVCacheManager.free`'s ``num_computed_tokens``), else a later request would hit KV
that is never written. vLLM frees them with their hashes.
"""

from __future__ import annotations

from scheduler.core.kv_cache_blocks import NO_NEW_BLOCKS, KVCacheBlocks
from scheduler.sched.plan_builder import StepPlanBuilder
from scheduler.sched.policy_options import SCHEDULING_POLICIES
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler, plan_drafts


def _victim_key(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class PriorityScheduler(Scheduler):
    policy = "priority"

    def _schedule_running(self, plan: StepPlanBuilder, cap: int) -> tuple[int, list[Request], list[Request], list[Request]]:
        """`Scheduler._schedule_running` (its decode fast path too), by index: a victim
        may stand before the request being scheduled, and leave the step."""
        running = self.running
        num_scheduled_tokens = plan.num_scheduled_tokens
        token_budget = self.step_token_budget
        preempted: list[Request] = []
        all_sampling = True  # every scheduled request completes its tokens
        # NOTE: running[:i] is scheduled: a victim before i leaves the step.
        i, n = 0, len(running)
        while i < n and token_budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            num_tokens = len(request.all_token_ids)
            num_new_tokens = num_tokens - num_computed
            drafts = request.spec_token_ids
            if drafts:
                num_new_tokens += len(drafts)
            elif num_new_tokens == 1 and num_computed < request.alloc_noop_until:
                request.num_computed_tokens = num_tokens
                token_budget -= 1
                i += 1
                continue
            if 0 < cap < num_new_tokens:
                num_new_tokens = cap
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            end = num_computed + num_new_tokens
            if end > request.alloc_noop_until:
                new_blocks, i, num_returned = self._allocate_or_preempt_by_priority(request, num_new_tokens, i, plan, preempted)
                token_budget += num_returned
                n = len(running)
                if new_blocks is None:
                    break  # it preempted itself: running[i:] is left out of the step
                if new_blocks is not NO_NEW_BLOCKS:
                    plan.append_blocks(request.seq_id, new_blocks)
            if drafts:
                plan_drafts(plan, request, end - num_tokens)
            if num_new_tokens != 1:
                num_scheduled_tokens[request.seq_id] = num_new_tokens
            request.num_computed_tokens = end
            if end < num_tokens:
                all_sampling = False
            token_budget -= num_new_tokens
            i += 1
        # Running rows left out of this step (budget spent) must say so: default is 1.
        for request in running[i:]:
            num_scheduled_tokens[request.seq_id] = 0
        scheduled = running[:i]
        sampling = scheduled.copy() if all_sampling else [r for r in scheduled if r.num_computed_tokens >= len(r.all_token_ids)]
        return token_budget, scheduled, sampling, preempted

    def _allocate_or_preempt_by_priority(
        self, request: Request, num_new_tokens: int, i: int, plan: StepPlanBuilder, preempted: list[Request],
    ) -> tuple[KVCacheBlocks | None, int, int]:
        """Room for ``num_new_tokens`` more tokens of ``request`` = running[i]: its new
        blocks (None once it preempted itself), its index after the victims, and the
        tokens they gave back to the step. Out of blocks, preempt the lowest priority."""
        kv = self.kv_cache_manager
        running = self.running
        num_returned = 0
        while True:
            if num_new_tokens == 1:
                new_blocks = kv.allocate_next_slot(request)
            else:
                new_blocks = kv.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks, i, num_returned
            # NOTE: O(len(running)), as vLLM's; only when the pool is out of blocks.
            victim = max(running, key=_victim_key)
            v = running.index(victim)
            del running[v]
            if v < i:
                # Scheduled earlier in this step: out of it, tokens and row.
                i -= 1
                num_tokens = plan.unschedule(victim.seq_id)
                num_returned += num_tokens
                self._preempt(victim, victim.num_computed_tokens - num_tokens)
            else:
                self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return None, i, num_returned


def scheduler_class(policy: str) -> type[Scheduler]:
    """The scheduler of ``--scheduling-policy`` ``policy``: "fcfs" or "priority"."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"unknown scheduling policy {policy!r}: expected one of {', '.join(SCHEDULING_POLICIES)}")
    return PriorityScheduler if policy == "priority" else Scheduler
