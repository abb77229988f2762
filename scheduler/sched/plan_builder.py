"""StepPlanBuilder: one step's delta plan for the worker, gathered while it is scheduled.

The worker keeps a copy of every running row, so the plan says only what changed
(DESIGN.md, the contract): rows are sent whole once (new, or resumed after a
preemption), then only grow by appended block ids; finished and preempted rows are
named by seq_id; a row decodes one token unless the plan says otherwise. The host
tier's copies come from the KV-cache core as plain data (`HostTierCopies`) and go
out as the wire's `TierCopies`.

Hybrid models (KV-cache groups): the hybrid manager hands out one list of blocks per
group (`GroupedBlocks`) and one table per group; group 0's travel in the plan's own
fields as today, the other groups' and the sliding groups' nulled entries in
`StepPlan.groups` (None when a step has none, always with one group).
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

from protocol.worker_messages import (
    AppendedBlocks,
    GroupAppendedBlocks,
    GroupDeltas,
    NulledBlocks,
    RequestRow,
    StepPlan,
    TierCopies,
)
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.offload_tier import HostTierCopies
from scheduler.sched.request import Request

if TYPE_CHECKING:
    from scheduler.core.grouped_blocks import GroupedBlocks

_BLOCK_ID = attrgetter("block_id")


class StepPlanBuilder:
    """The row deltas of the step being scheduled; `build` makes its `StepPlan`."""

    __slots__ = ("num_scheduled_tokens", "new_rows", "resumed_rows", "appended", "group_rows", "group_appended")

    def __init__(self) -> None:
        # seq_id -> tokens scheduled, for the rows that do not decode exactly one
        # (a prefill chunk, or 0 for a running row left out of the step).
        self.num_scheduled_tokens: dict[int, int] = {}
        self.new_rows: list[RequestRow] = []
        self.resumed_rows: list[RequestRow] = []
        self.appended: list[AppendedBlocks] = []
        # Hybrid models only (None until a step has any): rows' tables of groups 1..N-1
        # by seq_id, and appends to those groups.
        self.group_rows: dict[int, list[list[int]]] | None = None
        self.group_appended: list[GroupAppendedBlocks] | None = None

    def append_blocks(self, seq_id: int, new_blocks: list[KVCacheBlock] | GroupedBlocks) -> None:
        """A running row's block table grew by ``new_blocks``: a list (one KV-cache
        group), or a GroupedBlocks (the hybrid manager's, one list per group)."""
        if new_blocks.__class__ is list:
            self.appended.append(AppendedBlocks(seq_id, list(map(_BLOCK_ID, new_blocks))))
            return
        first, *others = new_blocks.groups
        if first:
            self.appended.append(AppendedBlocks(seq_id, list(map(_BLOCK_ID, first))))
        for group, blocks in enumerate(others, 1):
            if blocks:
                if self.group_appended is None:
                    self.group_appended = []
                self.group_appended.append(GroupAppendedBlocks(seq_id, group, list(map(_BLOCK_ID, blocks))))

    def unschedule(self, seq_id: int) -> int:
        """A running row scheduled earlier in this step was preempted (the priority
        policy's victim): forget its tokens and appended blocks. Returns its tokens."""
        self.appended = [a for a in self.appended if a.seq_id != seq_id]
        if self.group_appended is not None:
            self.group_appended = [a for a in self.group_appended if a.seq_id != seq_id]
        return self.num_scheduled_tokens.pop(seq_id, 1)

    def add_row(self, request: Request, block_ids: list[int] | list[list[int]], num_computed_tokens: int, resumed: bool) -> None:
        """An admitted request's row, sent whole: new, or resumed after a preemption.
        ``block_ids``: its table, or one table per KV-cache group (the hybrid manager's)."""
        if block_ids and block_ids[0].__class__ is list:
            block_ids, *others = block_ids
            if others:
                if self.group_rows is None:
                    self.group_rows = {}
                self.group_rows[request.seq_id] = others
        row = RequestRow(request.seq_id, list(request.all_token_ids), block_ids, num_computed_tokens, request.sampling)
        (self.resumed_rows if resumed else self.new_rows).append(row)

    def build(self, step_id: int, finished_seq_ids: list[int], preempted: list[Request], copies: HostTierCopies | None,
              nulled: list[tuple[int, int, int]] | None = None) -> StepPlan:  # fmt: skip
        """The step's plan: its deltas, the rows to drop, and the host tier's stores
        and loads (``copies``; None without a tier or without copies). ``nulled``: the
        hybrid manager's (seq_id, group, num_null_blocks) since the last step; only rows
        live after this step are named (a dropped row's table goes with it)."""
        groups = None
        if nulled or self.group_rows is not None or self.group_appended is not None:
            groups = self._group_deltas(finished_seq_ids, preempted, nulled or [])
        tier_copies = None
        if copies is not None:
            tier_copies = TierCopies(copies.store_device_ids, copies.store_host_ids, copies.load_host_ids, copies.load_device_ids)
        return StepPlan(
            step_id=step_id,
            num_scheduled_tokens=self.num_scheduled_tokens,
            new_rows=self.new_rows,
            resumed_rows=self.resumed_rows,
            appended=self.appended,
            finished_seq_ids=finished_seq_ids,
            preempted_seq_ids=[r.seq_id for r in preempted],
            tier_copies=tier_copies,
            groups=groups,
        )

    def _group_deltas(self, finished_seq_ids: list[int], preempted: list[Request], nulled: list[tuple[int, int, int]]) -> GroupDeltas:
        dropped = {*finished_seq_ids, *(r.seq_id for r in preempted)}
        return GroupDeltas(
            rows=self.group_rows or {},
            appended=self.group_appended or [],
            nulled=[NulledBlocks(sid, group, n) for sid, group, n in nulled if sid not in dropped],
        )
