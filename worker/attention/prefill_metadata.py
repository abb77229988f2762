"""A step's prefill chunks as attention reads them: the rows the in-place kernel takes,
or, for the gather path, each chunk's blocks and causal mask (with a sliding window, a
long chunk in pieces that each read only the blocks their windows reach).

A chunk is (row, num_computed, n): the queries at positions [num_computed, num_computed
+ n) of the block table's ``row``; the step's prefill tokens follow its decode tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.attention.metadata import PrefillChunk, PrefillRows, first_if_consecutive

# NOTE: a windowed prefill chunk is attended in pieces of at least this many queries, so
# a long chunk reads about (piece + W) keys per query, not the whole prefix; below it
# the calls' fixed cost would outweigh the keys saved.
WINDOW_PIECE_TOKENS = 256


def prefill_rows(block_table: torch.Tensor, prefills: list[tuple[int, int, int]], offset: int) -> PrefillRows:
    """The chunks as the kernel reads them; their tokens follow the step's ``offset``
    decode tokens."""
    rows, first, n = (np.fromiter((p[i] for p in prefills), dtype=np.int64, count=len(prefills)) for i in range(3))
    starts = offset + np.concatenate(([0], np.cumsum(n)[:-1]))
    return PrefillRows(block_table, rows, first, n, starts)


def prefill_chunks(
    block_table: torch.Tensor, table_np: np.ndarray | None, prefills: list[tuple[int, int, int]], offset: int,
    block_size: int, positions: torch.Tensor, window: int = 0,
) -> list[PrefillChunk]:
    """Each chunk's blocks and causal mask, for the gather path. ``positions``: 0, 1, ...
    on the table's device, at least a whole row's keys. ``table_np``: the table readable
    on the host (None: no chunk is marked as reading consecutive blocks). With a window,
    a chunk is attended in pieces of at most ``max(window, WINDOW_PIECE_TOKENS)`` queries."""
    chunks: list[PrefillChunk] = []
    for row, num_computed, n in prefills:
        piece = max(window, WINDOW_PIECE_TOKENS) if window else n
        for s in range(0, n, piece):
            m = min(piece, n - s)
            chunks.append(_prefill_chunk(block_table, table_np, block_size, positions, row, num_computed + s, m, offset + s, window))
        offset += n
    return chunks


def _prefill_chunk(
    block_table: torch.Tensor, table_np: np.ndarray | None, bs: int, positions: torch.Tensor, row: int, first: int,
    n: int, offset: int, window: int,
) -> PrefillChunk:
    """Queries at positions [first, first + n) of ``row``, tokens [offset, offset + n) of the step."""
    device = block_table.device
    nb = -(-(first + n) // bs)
    # The first column the first query's window reaches (0 without a window).
    c0 = max(0, first - window + 1) // bs if window else 0
    ids = block_table[row, c0:nb].long()
    query_pos = torch.arange(first, first + n, device=device)[:, None]  # (n, 1)
    key_pos = positions[c0 * bs : nb * bs][None, :]  # (1, L)
    mask = key_pos <= query_pos  # (n, L)
    if window:
        mask &= key_pos > query_pos - window
    first_block = first_if_consecutive(table_np[row, c0:nb]) if table_np is not None else None
    return PrefillChunk(offset, offset + n, ids, nb - c0, mask, first_block)
