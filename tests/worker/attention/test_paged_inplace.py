"""Paged attention reads a run of consecutive block ids in place (a view of the cache)
instead of gathering it: the same K/V at scattered ids must give the same output, and a
run broken anywhere must be gathered."""

from __future__ import annotations

import torch

from worker.attention.paged_attention import PagedAttention
from worker.kv.kv_cache import allocate_kv_caches
from worker.step.block_table import BlockTable

BS, KVH, NH, HD, NUM_BLOCKS = 4, 2, 8, 16, 48


def prefill(blocks: list[int], source: torch.Tensor, source_blocks: list[int]):
    """A 6-token chunk after 5 computed tokens of one request whose blocks are ``blocks``,
    holding the K/V ``source`` has at ``source_blocks``; returns (output, metadata)."""
    cache = allocate_kv_caches(1, NUM_BLOCKS, BS, KVH, HD, torch.float64, "cpu")[0]
    cache[:, blocks] = source[:, source_blocks]
    table = BlockTable(1, 8, BS, "cpu")
    table.add_row(0, blocks)
    table.commit()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, NH, HD, generator=gen, dtype=torch.float64)
    k = torch.randn(6, KVH, HD, generator=gen, dtype=torch.float64)
    v = torch.randn(6, KVH, HD, generator=gen, dtype=torch.float64)
    slots = table.compute_slot_mapping(torch.zeros(6, dtype=torch.long), torch.arange(5, 11))
    attention = PagedAttention([cache], NH, 8)
    md = attention.build_metadata(table.block_table, slots, [], [], [(0, 5, 6)])
    with torch.inference_mode():
        return attention.forward(0, q, k, v, md), md


def test_a_consecutive_run_read_in_place_equals_the_same_blocks_gathered():
    source = torch.randn((2, NUM_BLOCKS, BS, KVH, HD), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    in_place, md = prefill([3, 4, 5], source, [3, 4, 5])
    gathered, md_g = prefill([40, 9, 22], source, [3, 4, 5])
    assert md.prefills[0].first_block == 3 and md_g.prefills[0].first_block is None
    torch.testing.assert_close(in_place, gathered, rtol=0, atol=1e-12)
    # A run broken at its end is no run: gathered.
    _, md_b = prefill([3, 4, 6], source, [3, 4, 5])
    assert md_b.prefills[0].first_block is None
