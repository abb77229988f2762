"""KV-cache usage beyond vLLM's gauge: the peak since start, and usage in tokens.

Block size 4 throughout; tokens are small integers.
"""

from __future__ import annotations

import pytest
from kvtest.kv_manager import admit, manager, req

from scheduler.core.kv_cache_usage import get_num_held_tokens, get_peak_usage, get_token_usage

A8 = [1, 2, 3, 4, 5, 6, 7, 8]
A10 = A8 + [9, 10]


def test_peak_usage_is_the_highest_usage_since_start():
    m = manager()  # 15 usable blocks
    r0, r1 = req("r0", A10), req("r1", [20 + t for t in A10])
    admit(m, r0)
    admit(m, r1)  # 6 blocks held
    m.free(r0)
    m.free(r1)
    assert m.usage == 0.0 and get_peak_usage(m) == pytest.approx(6 / 15)
    admit(m, req("r2", A8))  # 2 blocks (both hits): below the peak
    assert get_peak_usage(m) == pytest.approx(6 / 15)


def test_token_usage_counts_filled_slots_and_shared_blocks_once():
    m = manager()  # 15 usable blocks of 4: 60 token slots
    r0, r1 = req("r0", A10), req("r1", A10)
    admit(m, r0)
    admit(m, r1)  # hits r0's 2 full blocks; each has a private block holding 2 tokens
    # Blocks held: 2 shared (8 tokens) + 2 tails (2 tokens each) = 4 blocks, 12 tokens.
    assert m.usage == pytest.approx(4 / 15)
    assert get_num_held_tokens(m, [r0, r1]) == 12
    assert get_token_usage(m, [r0, r1]) == 12 / 60
    m.free(r0)
    m.free(r1)
    assert get_num_held_tokens(m, []) == 0
