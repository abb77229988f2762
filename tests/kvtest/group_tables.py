"""A replica of the worker's block tables per KV-cache group, kept only from the
plans' deltas (the contract's apply order): what a hybrid worker holds."""

from __future__ import annotations

from protocol.worker_messages import StepPlan


class GroupTables:
    def __init__(self, num_groups: int):
        self.num_groups = num_groups
        # seq_id -> one table per group.
        self.rows: dict[int, list[list[int]]] = {}

    def apply(self, plan: StepPlan) -> None:
        assert (plan.groups is None) == (self.num_groups == 1 and plan.groups is None)
        for seq_id in [*plan.finished_seq_ids, *plan.preempted_seq_ids]:
            self.rows.pop(seq_id, None)
        groups = plan.groups
        for row in [*plan.new_rows, *plan.resumed_rows]:
            assert row.seq_id not in self.rows, f"row {row.seq_id} sent whole twice"
            rest = groups.rows.get(row.seq_id, []) if groups is not None else []
            assert len(rest) == self.num_groups - 1, (
                f"row {row.seq_id}: {len(rest)} tables beyond group 0"
            )
            self.rows[row.seq_id] = [list(row.block_ids), *map(list, rest)]
        for a in plan.appended:
            self.rows[a.seq_id][0].extend(a.block_ids)
        if groups is None:
            return
        for a in groups.appended:
            assert 1 <= a.group < self.num_groups
            self.rows[a.seq_id][a.group].extend(a.block_ids)
        for n in groups.nulled:
            table = self.rows[n.seq_id][n.group]
            assert n.num_blocks <= len(table)
            table[: n.num_blocks] = [0] * n.num_blocks
