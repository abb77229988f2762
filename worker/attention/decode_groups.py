"""The grouped decode path's metadata: consecutive decode rows in groups whose blocks,
padded to the group's widest row, fit the gather workspace together (``DecodeGroup``).

NOTE: grouping keeps the gathered K/V hot in the CPU cache for SDPA (one gather of a
whole large batch is slower than several groups of a few requests).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.attention.metadata import DecodeGroup


class DecodeGrouper:
    """Cuts a step's decode rows into workspace groups, with each group's padding bias."""

    def __init__(self, block_size: int, workspace_blocks: int, positions: torch.Tensor, read_dtype: torch.dtype):
        """positions: 0 .. max_blocks_per_seq * block_size - 1 on the device; read_dtype:
        the dtype of the bias (the one SDPA attends in)."""
        self.block_size = block_size
        self.workspace_blocks = workspace_blocks
        self.positions = positions
        self.read_dtype = read_dtype

    def groups(
        self, block_table: torch.Tensor, rows_np: np.ndarray, own: np.ndarray, skip: np.ndarray, lead: list[int] | None = None
    ) -> list[DecodeGroup]:
        """rows_np, own, skip: per row (B,), its table row, its keys after its first own
        column, and that column. ``lead``: per row, the keys of its first column before its
        window (masked), None without a window."""
        device = block_table.device
        own_blocks = (-(-own // self.block_size)).tolist()
        own_list = own.tolist()
        rows = torch.from_numpy(rows_np).to(device)  # (B,)
        first_col = torch.from_numpy(skip).to(device)  # (B,)
        num_rows = len(own_list)
        groups: list[DecodeGroup] = []
        start, widest = 0, 0
        for i in range(num_rows + 1):
            nb = own_blocks[i] if i < num_rows else 0
            at_end = i == num_rows
            if at_end or (i > start and (i - start + 1) * max(widest, nb) > self.workspace_blocks):
                groups.append(self._group(block_table, rows, first_col, own_list, start, i, widest, lead))
                start, widest = i, 0
            widest = max(widest, nb)
        return groups

    def _group(
        self, block_table: torch.Tensor, rows: torch.Tensor, first_col: torch.Tensor, own_list: list[int], start: int, end: int, widest: int,
        lead: list[int] | None = None,
    ) -> DecodeGroup:
        """Rows [start, end): ``widest`` block ids each from its first own column, and the
        bias that masks each row's padding and keys before its window (None when no row
        has either)."""
        bs, device = self.block_size, block_table.device
        max_col = block_table.shape[1] - 1
        cols = first_col[start:end, None] + torch.arange(widest, device=device)  # (n, widest)
        # NOTE: columns past a row's blocks read whatever block is there (the
        # null block or a clamped id); the bias masks them out.
        ids = block_table[rows[start:end, None], cols.clamp_(max=max_col)].reshape(-1).long()
        bias = None
        leading = lead is not None and any(lead[start:end])
        if leading or any(n_own != widest * bs for n_own in own_list[start:end]):
            lens = torch.tensor(own_list[start:end], device=device)
            pad = self.positions[: widest * bs] >= lens[:, None]  # (n, L)
            if leading:
                pad |= self.positions[: widest * bs] < torch.tensor(lead[start:end], device=device)[:, None]
            bias = torch.zeros(pad.shape, dtype=self.read_dtype, device=device).masked_fill_(pad, float("-inf"))
            bias = bias[:, None, None, :]  # (n, 1, 1, L)
        return DecodeGroup(start, end, ids, widest, bias)
