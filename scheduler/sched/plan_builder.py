"""StepPlanBuilder: one step's delta plan for the worker, gathered while it is scheduled.

The worker keeps a copy of every running row, so the plan says only what changed
(DESIGN.md, the contract): rows are sent whole once (new, or resumed after a
preemption), then only grow by appended block ids; finished and preempted rows are
named by seq_id; a row decodes one token unless the plan says otherwise. The host
tier's copies come from the KV-cache core as plain data (`HostTierCopies`) and go
out as the wire's `TierCopies`.

With hybrid KV-cache groups (``hybrid=True``) the tables of groups 1.. and the
leading entries a sliding window nulled go in the plan's `GroupDeltas`; group 0's
travel as with one group, in a `HybridStepPlan`. With one group the plan is a StepPlan, exactly as before.
"""

from __future__ import annotations

from operator import attrgetter

from protocol.worker_messages import (
    AppendedBlocks,
    ExternalKVOps,
    GroupAppendedBlocks,
    GroupDeltas,
    HybridSpecStepPlan,
    HybridStepPlan,
    KVTransferOps,
    NulledBlocks,
    RequestRow,
    SpecStepPlan,
    StepPlan,
    TierCopies,
)
from scheduler.core.external_tier import ExternalOps
from scheduler.core.grouped_blocks import GroupedBlocks
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.offload_tier import HostTierCopies
from scheduler.sched.request import Request

_BLOCK_ID = attrgetter("block_id")


class StepPlanBuilder:
    """The row deltas of the step being scheduled; `build` makes its `StepPlan`."""

    __slots__ = ("num_scheduled_tokens", "new_rows", "resumed_rows", "appended", "groups", "spec_token_ids")

    def __init__(self, hybrid: bool = False) -> None:
        # seq_id -> tokens scheduled, for the rows that do not decode exactly one
        # (a prefill chunk, or 0 for a running row left out of the step).
        self.num_scheduled_tokens: dict[int, int] = {}
        self.new_rows: list[RequestRow] = []
        self.resumed_rows: list[RequestRow] = []
        self.appended: list[AppendedBlocks] = []
        # seq_id -> the drafts scheduled after its last token (speculative decoding).
        self.spec_token_ids: dict[int, list[int]] = {}
        # Hybrid KV-cache groups: the deltas beyond group 0's (None with one group).
        self.groups: GroupDeltas | None = GroupDeltas(rows={}, appended=[], nulled=[]) if hybrid else None

    def append_blocks(self, seq_id: int, new_blocks: list[KVCacheBlock] | GroupedBlocks) -> None:
        """A running row's block table grew by ``new_blocks`` (with hybrid groups: per group)."""
        if type(new_blocks) is not GroupedBlocks:
            self.appended.append(AppendedBlocks(seq_id, list(map(_BLOCK_ID, new_blocks))))
            return
        first, *rest = new_blocks.groups
        if first:
            self.appended.append(AppendedBlocks(seq_id, list(map(_BLOCK_ID, first))))
        for group, blocks in enumerate(rest, 1):
            if blocks:
                self.groups.appended.append(GroupAppendedBlocks(seq_id, group, list(map(_BLOCK_ID, blocks))))

    def unschedule(self, seq_id: int) -> int:
        """A running row scheduled earlier in this step was preempted (the priority
        policy's victim): forget its tokens and appended blocks. Returns its tokens."""
        self.appended = [a for a in self.appended if a.seq_id != seq_id]
        if self.groups is not None:
            self.groups.appended = [a for a in self.groups.appended if a.seq_id != seq_id]
        self.spec_token_ids.pop(seq_id, None)
        return self.num_scheduled_tokens.pop(seq_id, 1)

    def add_row(self, request: Request, block_ids: list[int] | list[list[int]], num_computed_tokens: int, resumed: bool) -> None:
        """An admitted request's row, sent whole: new, or resumed after a preemption.
        With hybrid groups ``block_ids`` is one table per group."""
        if self.groups is not None:
            block_ids, *rest = block_ids
            if rest:
                self.groups.rows[request.seq_id] = rest
        row = RequestRow(request.seq_id, list(request.all_token_ids), block_ids, num_computed_tokens, request.sampling)
        (self.resumed_rows if resumed else self.new_rows).append(row)

    def build(self, step_id: int, finished_seq_ids: list[int], preempted: list[Request], copies: HostTierCopies | None,
              nulled: list[tuple[int, int, int]] | None = None, external: ExternalOps | None = None,
              kv_transfer: KVTransferOps | None = None) -> StepPlan:
        """The step's plan: its deltas, the rows to drop, and the host tier's stores
        and loads (``copies``; None without a tier or without copies). ``nulled``:
        (seq_id, group, leading null entries) of rows live at the end of the step. ``external``:
        the external tier's saves and loads (None: none); ``kv_transfer``: P/D disaggregation's
        lends and pulls (None: none)."""
        if nulled:
            self.groups.nulled.extend(NulledBlocks(seq_id, group, n) for seq_id, group, n in nulled)
        tier_copies = None
        if copies is not None:
            tier_copies = TierCopies(copies.store_device_ids, copies.store_host_ids, copies.load_host_ids, copies.load_device_ids)
        fields = dict(
            step_id=step_id,
            num_scheduled_tokens=self.num_scheduled_tokens,
            new_rows=self.new_rows,
            resumed_rows=self.resumed_rows,
            appended=self.appended,
            finished_seq_ids=finished_seq_ids,
            preempted_seq_ids=[r.seq_id for r in preempted],
            tier_copies=tier_copies,
        )
        if external is not None:
            fields["external"] = ExternalKVOps(external.save_block_ids, external.save_keys, external.load_ids, external.load_keys, external.load_block_ids)
        if kv_transfer is not None:
            fields["kv_transfer"] = kv_transfer
        if self.spec_token_ids:
            if self.groups is None:
                return SpecStepPlan(**fields, spec_token_ids=self.spec_token_ids)
            return HybridSpecStepPlan(**fields, groups=self.groups, spec_token_ids=self.spec_token_ids)
        if self.groups is None:
            return StepPlan(**fields)
        return HybridStepPlan(**fields, groups=self.groups)
