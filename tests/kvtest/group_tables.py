"""A replica of the worker's block tables per KV-cache group, kept only from the
plans' deltas (the contract's apply order): what a hybrid worker holds."""

from __future__ import annotations

from protocol.worker_messages import (
    AppendedBlocks,
    GroupAppendedBlocks,
    GroupRequestRow,
    NulledBlocks,
    StepPlan,
)


class GroupTables:
    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        # seq_id -> one table per group.
        self.rows: dict[int, list[list[int]]] = {}

    def apply(self, plan: StepPlan) -> None:
        for seq_id in [*plan.finished_seq_ids, *plan.preempted_seq_ids]:
            self.rows.pop(seq_id, None)
        for row in [*plan.new_rows, *plan.resumed_rows]:
            assert row.seq_id not in self.rows, f"row {row.seq_id} sent whole twice"
            # A one-group model's rows are plain RequestRows, a hybrid model's GroupRequestRows.
            assert (type(row) is GroupRequestRow) == (self.num_groups > 1)
            rest = row.group_block_ids
            assert len(rest) == self.num_groups - 1, (
                f"row {row.seq_id}: {len(rest)} tables beyond group 0"
            )
            self.rows[row.seq_id] = [list(row.block_ids), *map(list, rest)]
        for a in plan.appended:
            if type(a) is NulledBlocks:
                table = self.rows[a.seq_id][a.group]
                assert a.num_blocks <= len(table)
                table[: a.num_blocks] = [0] * a.num_blocks
            else:
                assert type(a) is AppendedBlocks or (type(a) is GroupAppendedBlocks and 1 <= a.group < self.num_groups)
                self.rows[a.seq_id][a.group].extend(a.block_ids)
