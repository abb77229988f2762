"""The spec's walkthrough (kv-cache-internals.md, "Code"), driven through the real
KVCacheManager and BlockPool (block size 4, 11 blocks, four requests), line for
line, and its "Try it" question on usage. The free-policy questions are in
tests/simulator/test_free_policies.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtest.walkthrough import BLOCK_SIZE, admit_tokens, run_walkthrough

from scheduler.core.kv_cache_manager import KVCacheManager

EXPECTED = Path(__file__).resolve().parents[4] / "shared" / "testdata" / "seed_walkthrough.expected.txt"


def test_walkthrough_prints_the_expected_output_line_for_line():
    expected = EXPECTED.read_text()
    got, _ = run_walkthrough()
    # The program prints each line with a newline, and a blank line after each queue.
    assert (got + "\n").splitlines() == expected.splitlines()
    assert got + "\n" == expected


def test_try_it_usage_stays_below_one_when_only_hashed_blocks_are_free():
    manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64)
    pool = manager.block_pool
    # Fill the whole pool with full (hashed) blocks, then let the requests finish.
    reqs = [admit_tokens(manager, f"r{i}", list(range(10 * i + 100, 10 * i + 108))) for i in range(5)]
    assert pool.get_usage() == 1.0
    for r in reqs:
        manager.free(r)
    usage_after = pool.get_usage()
    # Every free block holds a hash: the cache is full, yet usage reads 0.
    assert usage_after == 0.0
    assert all(b.block_hash is not None for b in pool.free_block_queue)
    assert pool.num_free_cached_blocks == 10
    # Hold 4 of them again: usage is 0.4 < 1.0 while every free block is cached data,
    # so the next allocation must evict.
    admit_tokens(manager, "s", list(range(500, 516)))
    assert pool.get_usage() == pytest.approx(0.4)
    assert all(b.block_hash is not None for b in pool.free_block_queue)
    before = pool.num_evictions
    pool.get_new_blocks(1)
    assert pool.num_evictions == before + 1
    pool.check_invariants()
