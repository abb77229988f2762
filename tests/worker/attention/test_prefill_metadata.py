"""A step's prefill chunks as each attention path reads them (worker/attention/prefill_metadata.py):
the kernel's rows, the gather path's blocks and masks, a window's pieces."""

import numpy as np
import torch

from worker.attention.prefill_metadata import WINDOW_PIECE_TOKENS, prefill_chunks, prefill_rows

BLOCK = 4


def _table(rows: list[list[int]], width: int = 8) -> torch.Tensor:
    t = torch.zeros((len(rows), width), dtype=torch.int32)
    for i, r in enumerate(rows):
        t[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return t


def test_the_kernel_rows_follow_the_decode_tokens_chunk_after_chunk():
    table = _table([[5, 6, 7], [1, 2]])
    r = prefill_rows(table, [(0, 2, 5), (1, 0, 3)], offset=3)
    assert r.table is table
    assert r.table_row.tolist() == [0, 1]
    assert r.first.tolist() == [2, 0]
    assert r.num_queries.tolist() == [5, 3]
    assert r.offset.tolist() == [3, 8]  # 3 decode tokens, then 5 of the first chunk


def test_a_chunk_reads_its_blocks_up_to_its_last_query_under_a_causal_mask():
    table = _table([[5, 6, 7], [9, 3, 4]])
    positions = torch.arange(8 * BLOCK)
    chunks = prefill_chunks(table, table.numpy(), [(0, 2, 5), (1, 0, 6)], 1, BLOCK, positions)
    a, b = chunks
    # Queries at positions 2..6 reach block column 1: two blocks, 8 keys.
    assert (a.start, a.end, a.num_ctx_blocks, a.block_ids.tolist(), a.first_block) == (1, 6, 2, [5, 6], 5)
    expected = [[key <= query for key in range(8)] for query in range(2, 7)]
    assert a.mask.tolist() == expected
    # 9, 3 do not run consecutively: gathered, not read in place.
    assert (b.start, b.end, b.block_ids.tolist(), b.first_block) == (6, 12, [9, 3], None)


def test_without_the_host_table_no_chunk_is_read_in_place():
    table = _table([[5, 6]])
    (c,) = prefill_chunks(table, None, [(0, 0, 8)], 0, BLOCK, torch.arange(8 * BLOCK))
    assert c.first_block is None and c.block_ids.tolist() == [5, 6]


def test_a_window_masks_keys_before_it_and_skips_columns_wholly_before_it():
    table = _table([[5, 6, 7, 8]])
    (c,) = prefill_chunks(table, table.numpy(), [(0, 10, 3)], 0, BLOCK, torch.arange(8 * BLOCK), window=3)
    # Query 10 sees 8..10: columns 0 and 1 (keys 0..7) are wholly before every query's
    # window; query 12 reaches column 3.
    assert c.block_ids.tolist() == [7, 8] and c.num_ctx_blocks == 2
    keys = range(8, 16)
    assert c.mask.tolist() == [[q - 3 < key <= q for key in keys] for q in (10, 11, 12)]


def test_a_long_windowed_chunk_is_attended_in_pieces_reading_only_their_blocks():
    block = 16
    n = WINDOW_PIECE_TOKENS + 44
    row = list(range(100, 100 + 20))
    table = _table([row], width=20)
    chunks = prefill_chunks(table, table.numpy(), [(0, 0, n)], 2, block, torch.arange(20 * block), window=2)
    assert [(c.start, c.end) for c in chunks] == [(2, 2 + WINDOW_PIECE_TOKENS), (2 + WINDOW_PIECE_TOKENS, 2 + n)]
    second = chunks[1]
    # Its first query, at 256, sees 255 and 256: from column 15 on, to column 18 (key 299).
    first_col, last_col = (WINDOW_PIECE_TOKENS - 1) // block, (n - 1) // block
    assert second.block_ids.tolist() == row[first_col : last_col + 1]
    assert np.array_equal(second.mask.sum(1).numpy(), np.full(n - WINDOW_PIECE_TOKENS, 2))
