"""The step plan of a hybrid model (KV-cache groups): group 0's deltas in the plan's own
fields as with one group, the other groups' rows and appends and every sliding group's
nulled entries in ``StepPlan.groups``; a one-group step's plan is today's, groups None."""

from __future__ import annotations

from protocol.worker_messages import (
    AppendedBlocks,
    GroupAppendedBlocks,
    GroupDeltas,
    NulledBlocks,
    RequestRow,
    StepPlan,
)
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.plan_builder import StepPlanBuilder
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler


class Grouped:
    """What the hybrid manager hands out (scheduler.core.grouped_blocks.GroupedBlocks):
    one list of blocks per group."""

    def __init__(self, *groups: list[int]):
        self.groups = tuple([KVCacheBlock(b) for b in ids] for ids in groups)

    def __bool__(self) -> bool:
        return any(self.groups)


def request(seq_id: int) -> Request:
    return Request(f"r{seq_id}", [1, 2, 3, 4, 5], 4, seq_id=seq_id)


def test_one_group_plan_is_todays_with_no_groups():
    plan = StepPlanBuilder()
    plan.add_row(request(1), [3, 4], 0, resumed=False)
    plan.append_blocks(2, [KVCacheBlock(7)])
    built = plan.build(5, [], [], None)
    assert built == StepPlan(5, new_rows=[RequestRow(1, [1, 2, 3, 4, 5], [3, 4])], appended=[AppendedBlocks(2, [7])])
    assert built.groups is None


def test_hybrid_rows_appends_and_nulled_entries():
    plan = StepPlanBuilder()
    plan.add_row(request(1), [[0, 3], [4, 5], [6, 8]], 4, resumed=False)  # group 0 sliding, a prefix hit's null entry first
    plan.add_row(request(2), [[9], [10], [11]], 0, resumed=True)
    plan.append_blocks(3, Grouped([12], [], [13]))
    plan.append_blocks(4, Grouped([], [14], []))  # only a group past the first grew
    built = plan.build(6, [5], [request(7)], None, nulled=[(3, 0, 2), (5, 0, 1), (7, 1, 3), (4, 1, 1)])
    assert built.new_rows == [RequestRow(1, [1, 2, 3, 4, 5], [0, 3], 4)]
    assert built.resumed_rows == [RequestRow(2, [1, 2, 3, 4, 5], [9])]
    assert built.appended == [AppendedBlocks(3, [12])]
    # Rows 5 (finished) and 7 (preempted) are dropped this step: their nulled entries are not sent.
    assert built.groups == GroupDeltas(
        rows={1: [[4, 5], [6, 8]], 2: [[10], [11]]},
        appended=[GroupAppendedBlocks(3, 2, [13]), GroupAppendedBlocks(4, 1, [14])],
        nulled=[NulledBlocks(3, 0, 2), NulledBlocks(4, 1, 1)],
    )
    assert built.finished_seq_ids == [5] and built.preempted_seq_ids == [7]


def test_one_sliding_group_sends_only_nulled_entries():
    # Mistral with a window: one group; its tables are block_ids, its freed entries nulled.
    plan = StepPlanBuilder()
    plan.add_row(request(1), [[0, 0, 3]], 12, resumed=False)
    built = plan.build(0, [], [], None, nulled=[(2, 0, 4)])
    assert built.new_rows[0].block_ids == [0, 0, 3]
    assert built.groups == GroupDeltas(nulled=[NulledBlocks(2, 0, 4)])
    assert StepPlanBuilder().build(1, [], [], None, nulled=[]).groups is None


def test_unschedule_forgets_a_rows_group_appends():
    plan = StepPlanBuilder()
    plan.append_blocks(3, Grouped([12], [13]))
    plan.append_blocks(4, Grouped([14], [15]))
    assert plan.unschedule(3) == 1
    built = plan.build(0, [], [], None)
    assert built.appended == [AppendedBlocks(4, [14])] and built.groups.appended == [GroupAppendedBlocks(4, 1, [15])]


class NullingManager(KVCacheManager):
    """A one-group manager that also reports nulled entries, as the hybrid one does."""

    def __init__(self, *args, nulled, **kwargs):
        super().__init__(*args, **kwargs)
        self.nulled = nulled

    def take_nulled(self):
        nulled, self.nulled = self.nulled, []
        return nulled


def test_the_scheduler_names_nulled_rows_by_seq_id():
    kv = NullingManager(16, 4, 64, enable_caching=False, nulled=[("a", 0, 2), ("gone", 1, 1), ("b", 1, 3)])
    sched = Scheduler(kv, 4, 64, 64)
    sched.add_request(Request("a", [2, 3, 4, 5, 6], 4, seq_id=7))
    sched.add_request(Request("b", [2, 3], 4, seq_id=9))
    out = sched.schedule()
    # "gone" (freed, no longer a request of the scheduler) is left out.
    assert out.plan.groups == GroupDeltas(nulled=[NulledBlocks(7, 0, 2), NulledBlocks(9, 1, 3)])
