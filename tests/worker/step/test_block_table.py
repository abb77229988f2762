"""Block table rows, the host/device copies, and slot mapping (DESIGN.md rule 6)."""

from __future__ import annotations

import torch

from worker.step.block_table import BlockTable


def check_invariants(bt: BlockTable) -> None:
    rows = list(bt.row_of.values())
    assert len(set(rows)) == len(rows)
    assert sorted(rows + bt._free_rows) == list(range(bt.max_num_seqs))
    for r in range(bt.max_num_seqs):
        n = bt.num_blocks_per_row[r]
        assert torch.all(bt.block_table_cpu[r, n:] == 0), f"row {r} has ids past its length"
        if r not in rows:
            assert n == 0


def test_add_append_remove_rows():
    bt = BlockTable(max_num_seqs=3, max_blocks_per_seq=4, block_size=4, device="cpu")
    assert bt.add_row(10, [7, 3]) == 0
    assert bt.add_row(11, [5]) == 1
    bt.append(10, [9])
    assert bt.block_ids(10) == [7, 3, 9] and bt.num_blocks(10) == 3
    check_invariants(bt)
    bt.remove_row(10)
    check_invariants(bt)
    # The lowest free row is reused first.
    assert bt.add_row(12, [1, 2, 4, 6]) == 0
    assert bt.block_table_cpu[0].tolist() == [1, 2, 4, 6]
    check_invariants(bt)


def test_commit_copies_host_to_device_only_when_changed():
    bt = BlockTable(2, 3, 4, "cpu")
    bt.add_row(1, [4, 2])
    assert bt.block_table.sum() == 0  # not committed yet
    bt.commit()
    assert torch.equal(bt.block_table, bt.block_table_cpu)
    bt.block_table.fill_(0)  # a clean table is not copied again
    bt.commit()
    assert bt.block_table.sum() == 0


def test_slot_mapping_uses_the_block_at_position_over_block_size():
    bs = 4
    bt = BlockTable(2, 4, bs, "cpu")
    bt.add_row(1, [7, 3, 9])  # row 0
    bt.add_row(2, [5])  # row 1
    bt.commit()
    rows = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    positions = torch.tensor([0, 3, 4, 7, 9, 0, 2])
    slots = bt.compute_slot_mapping(rows, positions)
    # slot = block_id * block_size + position % block_size
    assert slots.tolist() == [7 * 4 + 0, 7 * 4 + 3, 3 * 4 + 0, 3 * 4 + 3, 9 * 4 + 1, 5 * 4 + 0, 5 * 4 + 2]
    assert slots.dtype == torch.int64


class UploadEvent:
    """Stands in for the CUDA event ``commit`` records after a non-blocking upload: at
    each ``synchronize`` it notes what the host table held (the upload's source)."""

    def __init__(self, bt: BlockTable):
        self.bt, self.recorded, self.seen_at_sync = bt, 0, []

    def record(self) -> None:
        self.recorded += 1

    def synchronize(self) -> None:
        self.seen_at_sync.append(self.bt.block_table_cpu.clone())


def test_a_host_edit_after_a_non_blocking_upload_waits_for_it_first():
    bt = BlockTable(2, 3, 4, "cpu")
    assert bt._copy_done is None  # CPU: copy_ is synchronous, nothing to wait for
    ev = bt._copy_done = UploadEvent(bt)
    bt.add_row(1, [4, 2])  # no upload yet: no wait
    bt.commit()
    assert ev.recorded == 1 and ev.seen_at_sync == []
    bt.append(1, [6])  # waits, then edits: at the wait the host table is what was uploaded
    bt.add_row(2, [5])  # the same step: no second wait
    assert [t.tolist() for t in ev.seen_at_sync] == [[[4, 2, 0], [0, 0, 0]]]
    bt.commit()
    bt.remove_row(1)
    assert len(ev.seen_at_sync) == 2 and ev.seen_at_sync[1].tolist() == [[4, 2, 6], [5, 0, 0]]
    bt.commit()
    bt.null_leading(2, 1)
    assert len(ev.seen_at_sync) == 3 and ev.seen_at_sync[2].tolist() == [[0, 0, 0], [5, 0, 0]]
    bt.commit()
    bt.commit()  # nothing changed: no upload, nothing recorded
    assert ev.recorded == 4 and bt.block_table.tolist() == [[0, 0, 0], [0, 0, 0]]
    check_invariants(bt)
