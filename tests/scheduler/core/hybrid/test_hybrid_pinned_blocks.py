"""Pins with two KV-cache groups (scheduler/core/retention/pinned_blocks.py over the hybrid
coordinator): block size 2, full attention (group 0) and a window of 4 (group 1), whose
hit needs the cdiv(4 - 1, 2) = 2 blocks ending at the hit. A pin holds every full-attention
block of the prefix and the sliding group's cached blocks of it (the tail ending at the
replay boundary), so a flood of other prompts cannot take the prompt's hit away; unpin,
expiry, a reset and the cap behave as with one group, counted in blocks across groups."""

from __future__ import annotations

import pytest

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.retention.pinned_blocks import PinRefused
from scheduler.sched.request import Request

BS = 2
HASHER = BlockHasher(BS)
PROMPT = list(range(100, 109))  # 9 tokens: 4 full blocks; the replay boundary 8 ends block 3
HASHES = HASHER.block_hashes(PROMPT)


def manager(fraction: float = 0.5) -> KVCacheManager:
    # 15 usable blocks; at 0.5, at most 7 pinned.
    return KVCacheManager(16, BS, 64, group_windows=[0, 4], max_pinned_fraction=fraction)


def serve(m: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """Admit the prompt whole, then free it; its prefix hit in tokens."""
    r = Request(rid, list(tokens), max_tokens=16, block_hasher=HASHER)
    hits, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, r.num_tokens - n, n, hits) is not None
    m.check_invariants()
    m.free(r)
    m.check_invariants()
    return n


def flood(m: KVCacheManager, n: int) -> None:
    # 7 tokens: 4 blocks in each group, 8 of the pool's blocks a prompt.
    for i in range(n):
        serve(m, f"flood{i}", [1000 * (i + 1) + t for t in range(7)])


def test_a_pinned_prefix_keeps_its_full_hit_through_a_flood_and_unpinned_it_does_not():
    m = manager()
    assert serve(m, "a", PROMPT) == 0
    out = m.pinned.pin(HASHES, now=0.0, num_tokens=len(PROMPT))
    # The prompt's 4 blocks; held: full attention's 4 and the sliding tail (blocks 2, 3).
    assert (out.num_blocks, out.num_missing) == (4, 0) and m.pinned.num_pinned_blocks == 6
    m.check_invariants()
    flood(m, 10)  # 80 blocks of other prompts through the 9 unpinned ones
    assert serve(m, "b", PROMPT) == 8  # the whole hit a resend can have (num_tokens - 1)
    assert m.pinned.unpin(HASHES).num_blocks == 4 and m.pinned.num_pinned_blocks == 0
    m.check_invariants()
    flood(m, 10)
    assert serve(m, "c", PROMPT) == 0


def test_a_prompt_of_whole_blocks_pins_the_tail_its_resend_reads():
    m = manager()
    prompt = PROMPT[:8]  # 4 full blocks; the replay boundary 7 ends block 2: the tail is blocks 1, 2
    hashes = HASHER.block_hashes(prompt)
    serve(m, "a", prompt)
    assert m.pinned.pin(hashes, now=0.0, num_tokens=8).num_blocks == 4
    assert m.pinned.num_pinned_blocks == 4 + 2
    flood(m, 10)
    assert serve(m, "b", prompt) == 6
    # Asked for the hit at the whole prefix (no token count), the sliding group lacks the
    # tail ending at block 4: one block to compute first, nothing more pinned.
    m.pinned.unpin(hashes)
    serve(m, "c", prompt)
    out = m.pinned.pin(hashes, now=0.0)
    assert (out.num_blocks, out.num_missing) == (0, 1) and m.pinned.num_pinned_blocks == 0


def test_pin_is_all_or_nothing_and_names_the_blocks_to_compute():
    m = manager()
    out = m.pinned.pin(HASHES, now=0.0, num_tokens=9)
    assert (out.num_blocks, out.num_missing) == (0, 4)
    serve(m, "a", PROMPT[:5])  # full attention caches blocks 0, 1
    out = m.pinned.pin(HASHES, now=0.0, num_tokens=9)
    assert (out.num_blocks, out.num_missing) == (0, 2) and m.pinned.num_pinned_blocks == 0
    assert m.block_pool.get_num_free_blocks() == 15
    m.check_invariants()


def test_the_cap_counts_blocks_across_groups_and_refuses_with_nothing_pinned():
    m = manager(fraction=0.3)  # at most 4 pinned: fewer than the 6 this prompt holds
    serve(m, "a", PROMPT)
    with pytest.raises(PinRefused, match="pinning 6 more blocks"):
        m.pinned.pin(HASHES, now=0.0, num_tokens=9)
    assert m.pinned.num_pinned_blocks == 0 and m.pinned.num_refusals == 1
    assert m.block_pool.get_num_free_blocks() == 15
    # A shorter prefix fits: 2 full-attention blocks and the sliding tail ending at block 2.
    short = PROMPT[:5]
    serve(m, "b", short)
    assert m.pinned.pin(HASHES[:2], now=0.0, num_tokens=5).num_blocks == 2
    assert m.pinned.num_pinned_blocks == 4
    m.check_invariants()


def test_pins_expire_and_a_reset_clears_them_in_every_group():
    m = manager()
    serve(m, "a", PROMPT)
    m.pinned.pin(HASHES, now=100.0, ttl_s=10, num_tokens=9)
    assert m.pinned.expire(109.0) == 0 and m.pinned.num_pinned_blocks == 6
    assert m.pinned.expire(110.0) == 6 and m.pinned.num_pinned_blocks == 0
    m.check_invariants()
    assert m.block_pool.get_num_free_blocks() == 15
    m.pinned.pin(HASHES, now=0.0, num_tokens=9)
    assert m.reset_prefix_cache() and m.pinned.num_cleared == 6
    m.check_invariants()
    assert serve(m, "b", PROMPT) == 0
