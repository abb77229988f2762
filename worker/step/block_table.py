"""The block table: a row of block ids per running request, on the host and the device.

Like vLLM's ``worker/step/block_table.py``: edits go to the host tensor, ``commit`` copies
it to the device once per step, and slot mappings are computed on the device from the
device copy. On CUDA the copy is non-blocking from pinned memory, so the host tensor
may still be being read after ``commit`` returns: every host edit first waits for the
last copy (an event recorded after it, as vLLM's ``synchronize_input_prep``). A request
is known here by ``seq_id``; rows are handed out from a free list and returned when the
request finishes or is preempted.

Invariants: ``row_of`` maps exactly the live seq_ids to distinct rows; a free row is
all zeros (the null block) and has ``num_blocks_per_row == 0``; the entries of a live
row past its ``num_blocks_per_row`` are zeros too, so a padded gather reads block 0.
A live row holds block 0 only in a leading run (a sliding-window group's entries
freed outside the window: ``null_leading``; hybrid KV-cache groups only).
"""

from __future__ import annotations

import torch


class BlockTable:
    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, device: torch.device | str):
        self.max_num_seqs = max_num_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        device = torch.device(device)
        pin = device.type == "cuda"
        self.block_table_cpu = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin)
        self.block_table = torch.zeros((max_num_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        # NOTE: a numpy view of the host tensor: row edits through it cost far less
        # than torch indexing from Python.
        self._table_np = self.block_table_cpu.numpy()
        self.num_blocks_per_row = [0] * max_num_seqs
        self.row_of: dict[int, int] = {}
        # Popped from the end, so the lowest free row is reused first.
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._dirty = False
        # NOTE: CUDA only: marks the end of the last non-blocking upload; None on CPU,
        # where the copy is done when copy_ returns.
        self._copy_done = torch.cuda.Event() if device.type == "cuda" else None
        self._copy_pending = False

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def add_row(self, seq_id: int, block_ids: list[int]) -> int:
        """Give ``seq_id`` a free row holding ``block_ids``; returns the row index."""
        assert seq_id not in self.row_of, seq_id
        self._wait_for_upload()
        row = self._free_rows.pop()
        self.row_of[seq_id] = row
        n = len(block_ids)
        self._table_np[row, :n] = block_ids
        self.num_blocks_per_row[row] = n
        self._dirty = True
        return row

    def append(self, seq_id: int, block_ids: list[int]) -> None:
        row = self.row_of[seq_id]
        self._wait_for_upload()
        start = self.num_blocks_per_row[row]
        end = start + len(block_ids)
        self._table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end
        self._dirty = True

    def remove_row(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id)
        self._wait_for_upload()
        self._table_np[row, : self.num_blocks_per_row[row]] = 0
        self.num_blocks_per_row[row] = 0
        self._free_rows.append(row)
        self._dirty = True

    def null_leading(self, seq_id: int, n: int) -> None:
        """Entries [0, n) of the row now hold the null block (a sliding-window group's
        blocks wholly outside the window, freed by the scheduler)."""
        self._wait_for_upload()
        self._table_np[self.row_of[seq_id], :n] = 0
        self._dirty = True

    def num_null_leading(self, seq_id: int) -> int:
        """How many of the row's first entries hold the null block."""
        row = self.row_of[seq_id]
        entries = self._table_np[row, : self.num_blocks_per_row[row]]
        nonzero = entries.nonzero()[0]
        return int(nonzero[0]) if len(nonzero) else len(entries)

    def num_blocks(self, seq_id: int) -> int:
        return self.num_blocks_per_row[self.row_of[seq_id]]

    def block_ids(self, seq_id: int) -> list[int]:
        row = self.row_of[seq_id]
        return self._table_np[row, : self.num_blocks_per_row[row]].tolist()

    def commit(self) -> None:
        """Copy the host table to the device if anything changed since the last commit."""
        if self._dirty:
            self.block_table.copy_(self.block_table_cpu, non_blocking=self._copy_done is not None)
            self._dirty = False
            if self._copy_done is not None:
                self._copy_done.record()
                self._copy_pending = True

    def _wait_for_upload(self) -> None:
        """Before a host edit: the last upload has read the host table (CUDA only)."""
        if self._copy_pending:
            self._copy_done.synchronize()
            self._copy_pending = False

    def compute_slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows, positions: (T,) int64 on the device -> slots (T,) int64.

        slot = block_id * block_size + position % block_size, with block_id the entry
        at index position // block_size of the row (DESIGN.md, rule 6). Call after
        ``commit``.
        """
        block_ids = self.block_table[rows, positions // self.block_size].long()  # (T,)
        return block_ids * self.block_size + positions % self.block_size
