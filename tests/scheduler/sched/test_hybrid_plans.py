"""The scheduler over hybrid KV-cache groups: every plan's deltas (group 0's rows and
appends, `GroupRequestRow`s and `GroupAppendedBlocks` for the others, the sliding windows'
`NulledBlocks`), applied
to a replica of the worker's tables (kvtest.group_tables), give exactly the manager's
tables after every step -- through chunked prefills, shared prefixes, decode,
preemptions (FCFS and priority) and aborts -- and a one-group plan has no group data."""

from __future__ import annotations

import random

import pytest
from kvtest.group_tables import GroupTables

from protocol.worker_messages import (
    GroupAppendedBlocks,
    NulledBlocks,
    RequestRow,
    StepPlan,
    StepResult,
)
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.retention.eviction_policies import eviction_pool_factory, kv_cache_manager_class
from scheduler.sched.priority_scheduler import scheduler_class
from scheduler.sched.request import Request, RequestStatus

BS = 4


def run(
    windows: list[int], num_blocks: int, seed: int, policy: str = "fcfs", budget: int = 24, eviction: str = "lru"
) -> dict:
    rng = random.Random(seed)
    hasher = BlockHasher(BS)
    pool = eviction_pool_factory(eviction, policy)
    kv = kv_cache_manager_class(policy)(
        num_blocks, BS, 128, group_windows=windows, pool_factory=pool, max_num_batched_tokens=budget
    )
    sched = scheduler_class(policy)(kv, 6, budget, 128)
    replica = GroupTables(len(windows))
    prefix = [rng.randrange(2, 60) for _ in range(12)]
    seen = {"nulled": 0, "group_appends": 0, "preemptions": 0, "rows": 0}
    for i in range(14):
        prompt = prefix[: rng.randrange(0, 13)] + [
            rng.randrange(2, 60) for _ in range(rng.randrange(1, 30))
        ]
        sched.add_request(Request(f"r{i}", prompt, rng.randrange(1, 30), seq_id=i, ignore_eos=True, eos_token_id=1,
                                  block_hasher=hasher, priority=rng.randrange(3)))
    for step in range(400):
        if step == 30 and "r3" in sched.requests:
            sched.finish_requests(["r3"], RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        if out is None:
            if not sched.has_unfinished_requests():
                break
            continue
        plan = out.plan
        replica.apply(plan)
        seen["nulled"] += sum(type(a) is NulledBlocks for a in plan.appended)
        seen["group_appends"] += sum(type(a) is GroupAppendedBlocks for a in plan.appended)
        seen["preemptions"] += len(plan.preempted_seq_ids)
        seen["rows"] += len(plan.new_rows) + len(plan.resumed_rows)
        assert set(replica.rows) == {r.seq_id for r in sched.running}
        for r in sched.running:
            assert replica.rows[r.seq_id] == list(kv.get_block_ids(r.request_id)), (
                f"step {plan.step_id} row {r.seq_id}"
            )
        kv.check_invariants()
        seq_ids = [r.seq_id for r in out.sampling]
        sched.update_from_output(
            StepResult(plan.step_id, seq_ids, [rng.randrange(2, 60) for _ in seq_ids])
        )
    assert not sched.has_unfinished_requests()
    assert kv.usage == 0.0
    return seen


@pytest.mark.parametrize(
    "windows,num_blocks", [([0, 8], 40), ([8, 0], 40), ([5, 5, 0], 50), ([6], 10)]
)
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_plans_deltas_rebuild_every_groups_tables(windows, num_blocks, policy):
    seen = {"nulled": 0, "group_appends": 0, "preemptions": 0, "rows": 0}
    for seed in range(3):
        for k, v in run(windows, num_blocks, seed, policy).items():
            seen[k] += v
    # The workload exercised what it tests: nulled entries, group appends (with groups
    # beyond the first) and preemptions (rows sent again).
    assert seen["nulled"] > 0 and seen["preemptions"] > 0
    assert (seen["group_appends"] > 0) == (len(windows) > 1)


@pytest.mark.parametrize("eviction", ["arc", "lfu", "s3fifo", "cost"])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_every_eviction_policy_keeps_every_groups_tables(eviction, policy):
    seen = {"nulled": 0, "preemptions": 0}
    for seed in range(3):
        out = run([0, 8], 40, seed, policy, eviction=eviction)
        seen["nulled"] += out["nulled"]
        seen["preemptions"] += out["preemptions"]
    assert seen["nulled"] > 0 and seen["preemptions"] > 0


def test_one_group_plans_carry_no_groups():
    kv = KVCacheManager(16, BS, 64)
    sched = scheduler_class("fcfs")(kv, 4, 16, 64)
    sched.add_request(Request("a", list(range(2, 12)), 3, seq_id=0, block_hasher=BlockHasher(BS)))
    out = sched.schedule()
    assert type(out.plan) is StepPlan and type(out.plan.new_rows[0]) is RequestRow
    assert out.plan.new_rows[0].block_ids == [1, 2, 3]
