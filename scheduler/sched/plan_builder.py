"""StepPlanBuilder: one step's delta plan for the worker, gathered while it is scheduled.

The worker keeps a copy of every running row, so the plan says only what changed
(DESIGN.md, the contract): rows are sent whole once (new, or resumed after a
preemption), then only grow by appended block ids; finished and preempted rows are
named by seq_id; a row decodes one token unless the plan says otherwise. The host
tier's copies come from the KV-cache core as plain data (`HostTierCopies`) and go
out as the wire's `TierCopies`.

One plan for one KV-cache group and for several: a hybrid model's rows are sent whole as
`GroupRequestRow`s (every group's table), its appends to groups 1.. as `GroupAppendedBlocks`
and the leading entries a sliding window nulled as `NulledBlocks`, in the same list as group
0's appends. A one-group model's plan holds none of them: its bytes are what they always were.
"""

from __future__ import annotations

from operator import attrgetter

from protocol.worker_messages import (
    AppendedBlocks,
    ExternalKVOps,
    GroupAppendedBlocks,
    GroupRequestRow,
    KVTransferOps,
    NulledBlocks,
    RequestRow,
    SpecStepPlan,
    StepPlan,
    TierCopies,
)
from scheduler.core.kv_cache_blocks import KVCacheBlocks
from scheduler.core.offload.external_tier import ExternalOps
from scheduler.core.offload.offload_tier import HostTierCopies
from scheduler.sched.request import Request

_BLOCK_ID = attrgetter("block_id")


class StepPlanBuilder:
    """The row deltas of the step being scheduled; `build` makes its `StepPlan`."""

    __slots__ = ("num_scheduled_tokens", "new_rows", "resumed_rows", "appended", "spec_token_ids")

    def __init__(self) -> None:
        # seq_id -> tokens scheduled, for the rows that do not decode exactly one
        # (a prefill chunk, or 0 for a running row left out of the step).
        self.num_scheduled_tokens: dict[int, int] = {}
        self.new_rows: list[RequestRow] = []
        self.resumed_rows: list[RequestRow] = []
        # Table deltas in order: appends, then (at build) nulled entries.
        self.appended: list[AppendedBlocks | GroupAppendedBlocks | NulledBlocks] = []
        # seq_id -> the drafts scheduled after its last token (speculative decoding).
        self.spec_token_ids: dict[int, list[int]] = {}

    def append_blocks(self, seq_id: int, new_blocks: KVCacheBlocks) -> None:
        """A running row's block tables grew by ``new_blocks`` (one list per KV-cache group)."""
        groups = new_blocks.blocks
        if groups[0]:
            self.appended.append(AppendedBlocks(seq_id, list(map(_BLOCK_ID, groups[0]))))
        # NOTE: one group (most models) stops here: no per-group loop on the decode path.
        if len(groups) > 1:
            for group in range(1, len(groups)):
                if groups[group]:
                    self.appended.append(GroupAppendedBlocks(seq_id, group, list(map(_BLOCK_ID, groups[group]))))

    def unschedule(self, seq_id: int) -> int:
        """A running row scheduled earlier in this step was preempted (the priority
        policy's victim): forget its tokens and appended blocks. Returns its tokens."""
        self.appended = [a for a in self.appended if a.seq_id != seq_id]
        self.spec_token_ids.pop(seq_id, None)
        return self.num_scheduled_tokens.pop(seq_id, 1)

    def add_row(self, request: Request, block_ids: tuple[list[int], ...], num_computed_tokens: int, resumed: bool) -> None:
        """An admitted request's row, sent whole: new, or resumed after a preemption.
        ``block_ids``: its table in each KV-cache group."""
        first, *rest = block_ids
        token_ids = list(request.all_token_ids)
        if rest:
            row = GroupRequestRow(request.seq_id, token_ids, first, num_computed_tokens, request.sampling, rest)
        else:
            row = RequestRow(request.seq_id, token_ids, first, num_computed_tokens, request.sampling)
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
            self.appended.extend(NulledBlocks(seq_id, group, n) for seq_id, group, n in nulled)
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
            return SpecStepPlan(**fields, spec_token_ids=self.spec_token_ids)
        return StepPlan(**fields)
