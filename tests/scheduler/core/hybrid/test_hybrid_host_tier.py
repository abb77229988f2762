"""The host tier (--kv-offloading-size) with hybrid KV-cache groups, by hand: block size 2,
a full-attention group (0) and a sliding group (1) of window 4, so the token at position p
reads blocks from (p - 3) // 2 on, and a hit of L tokens needs the sliding group's blocks
from (L - 3) // 2 to L / 2 - 1 only. Each group's block is held under its keyed hash: the
request's hash and the group id as 4 big-endian bytes (vLLM's BlockHashWithGroupId)."""

from __future__ import annotations

import pytest

from scheduler.core.hashing import BlockHasher
from scheduler.core.hybrid.hybrid_tier_hit import find_tier_hit, tier_load_keys
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload.offload_tier import HostTier
from scheduler.sched.request import Request

BS = 2
HASHER = BlockHasher(BS)
A = list(range(9))  # 9 tokens: full blocks 0..3 and a partial one
B = list(range(100, 109))


def keyed(block_hash: bytes, group: int) -> bytes:
    return block_hash + bytes([0, 0, 0, group])


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), max_tokens=4, block_hasher=HASHER)


def admit(kv: KVCacheManager, r: Request) -> int:
    """Admission as the scheduler does it; returns the hit length."""
    hits, n = kv.get_computed_blocks(r, record_stats=False)
    assert kv.allocate_slots(r, r.num_tokens - n, n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    kv.check_invariants()
    return n


def end_step(kv: KVCacheManager):
    copies = kv.take_tier_copies()
    kv.complete_tier_copies()
    kv.check_invariants()
    return copies


def stored(tier: HostTier, keys: list[bytes]) -> None:
    """Put ``keys`` in the tier as completed stores (device ids are only labels here)."""
    tier.prepare_stores([(i + 1, k) for i, k in enumerate(keys)])
    tier.take_copies()
    tier.complete_copies()


def test_an_evicted_prefix_comes_back_from_the_host_tier_for_every_group():
    tier = HostTier(16, BS)
    kv = KVCacheManager(11, BS, 64, host_tier=tier, group_windows=[0, 4])  # 10 usable blocks
    admit(kv, req("a", A))
    assert end_step(kv) is None
    a_ids = kv.get_block_ids("a")
    kv.free(req("a", A))
    # A cached full blocks 0..3 and the sliding tail ending at its replay boundary 8:
    # blocks 2, 3. B takes the whole pool: those six are evicted and stored, keyed.
    admit(kv, req("b", B))
    copies = end_step(kv)
    h = HASHER.block_hashes(A)
    want = {keyed(h[i], 0): a_ids[0][i] for i in range(4)} | {keyed(h[i], 1): a_ids[1][i] for i in (2, 3)}
    assert sorted(copies.store_device_ids) == sorted(want.values())
    slot_of = dict(zip(copies.store_device_ids, copies.store_host_ids, strict=True))
    assert {k: tier.blocks[k].slot for k in want} == {k: slot_of[d] for k, d in want.items()}
    kv.free(req("b", B))
    # A again: nothing on the device; the tier holds all four full blocks and the sliding
    # blocks 2, 3 the token at 8 reads (positions 5..8): a hit of 8 tokens, all host hits.
    a2 = req("a2", A)
    hits, n = kv.get_computed_blocks(a2, record_stats=False)
    assert hits.get_block_ids() == ([], []) and n == 8
    assert kv.allocate_slots(a2, 1, 8, hits) is not None
    a2.num_computed_tokens = 9
    kv.check_invariants()
    full, sliding = kv.get_block_ids("a2")
    # The sliding group's blocks 0, 1 are outside the window: null entries, never loaded.
    assert sliding[:2] == [0, 0] and 0 not in sliding[2:] and 0 not in full
    assert kv.take_nulled() == []  # a new row carries its leading nulls itself
    copies = end_step(kv)
    # One load per needed block, position by position, groups in order within one.
    order = [(0, 0), (0, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    assert copies.load_device_ids == [(full, sliding)[g][i] for g, i in order]
    assert copies.load_host_ids == [slot_of[want[keyed(h[i], g)]] for g, i in order]
    # The loaded blocks are cached under their keyed hashes: a device hit for the next request.
    pool = kv.block_pool
    assert [pool.blocks[full[i]].block_hash for i in range(4)] == [keyed(h[i], 0) for i in range(4)]
    assert [pool.blocks[sliding[i]].block_hash for i in (2, 3)] == [keyed(h[i], 1) for i in (2, 3)]
    hits, n = kv.get_computed_blocks(req("a3", A), record_stats=False)
    assert n == 8 and hits.get_block_ids() == (full[:4], [0, 0, *sliding[2:4]])
    assert tier.num_loads == 6
    kv.free(a2)
    kv.check_invariants()


def test_a_sliding_block_missing_from_the_tier_shortens_the_hit_not_monotonically():
    tier = HostTier(16, BS)
    kv = KVCacheManager(16, BS, 64, host_tier=tier, group_windows=[0, 4])
    h = HASHER.block_hashes(A)
    # Full blocks 0..3; sliding only 1 and 2. A hit of 8 needs sliding 2, 3 (3 missing);
    # of 6, sliding 1, 2 (held); of 4, sliding 0, 1 (0 missing): the search runs down
    # past the miss at 8 and stops at 6, though 4 would fail.
    stored(tier, [keyed(h[i], 0) for i in range(4)] + [keyed(h[1], 1), keyed(h[2], 1)])
    kv.check_invariants()
    a = req("a", A)
    hits, n = kv.get_computed_blocks(a, record_stats=False)
    assert n == 6
    assert kv.allocate_slots(a, 3, 6, hits) is not None
    a.num_computed_tokens = 9
    kv.check_invariants()
    full, sliding = kv.get_block_ids("a")
    assert sliding[0] == 0 and 0 not in sliding[1:]
    copies = end_step(kv)
    order = [(0, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert copies.load_device_ids == [(full, sliding)[g][i] for g, i in order]
    assert copies.load_host_ids == [tier.blocks[keyed(h[i], g)].slot for g, i in order]
    # Without sliding block 2 no hit reaches past the device's (none at all).
    tier2 = HostTier(16, BS)
    stored(tier2, [keyed(h[i], 0) for i in range(4)] + [keyed(h[1], 1)])
    kv2 = KVCacheManager(16, BS, 64, host_tier=tier2, group_windows=[0, 4])
    assert kv2.get_computed_blocks(req("a", A), record_stats=False)[1] == 0


class SetTier:
    """A tier holding exactly ``keys``."""

    def __init__(self, keys):
        self.keys = set(keys)

    def lookup(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.keys:
            n += 1
        return n

    def held(self, hashes):
        return [x in self.keys for x in hashes]


@pytest.mark.parametrize(
    "held, start, want",
    [
        # Windows [0, 6, 0] at block size 2: a hit of L needs group 1's blocks from (L - 5) // 2.
        ({0: range(6), 1: range(6), 2: range(6)}, 0, 6),
        # Group 2 (full) lacks block 4: at most 4 blocks; L = 8 needs group 1's 1..3.
        ({0: range(6), 1: [1, 2, 3], 2: [0, 1, 2, 3]}, 0, 4),
        # Group 1 lacks block 3: L = 12 (needs 3..5), 10 (2..4), 8 (1..3) fail; 6 needs 0..2.
        ({0: range(6), 1: [0, 1, 2, 4, 5], 2: range(6)}, 0, 3),
        # From a device hit of 2 blocks: group 1's blocks before it are the device's.
        ({0: range(2, 6), 1: [2], 2: range(2, 6)}, 2, 3),
        # Nothing held past the device's hit: no extension.
        ({0: [], 1: [], 2: []}, 2, 2),
    ],
)
def test_the_extension_search_by_hand(held, start, want):
    h = [bytes([i]) * 4 for i in range(6)]
    tier = SetTier(keyed(h[i], g) for g, blocks in held.items() for i in blocks)
    assert find_tier_hit([0, 6, 0], h, start, 6, BS, tier) == want


def test_the_loads_name_only_the_blocks_the_window_of_their_end_reads():
    h = [bytes([i]) * 4 for i in range(4)]
    # Blocks 1..3 loaded for a request at 8 tokens, window 4: group 1 reads from (8 - 3) // 2 = 2.
    assert tier_load_keys([0, 4], h, 1, 4, 8, BS) == [
        keyed(h[1], 0), keyed(h[2], 0), keyed(h[2], 1), keyed(h[3], 0), keyed(h[3], 1),
    ]


def test_write_through_stores_each_cached_block_under_its_keyed_hash():
    tier = HostTier(16, BS)
    kv = KVCacheManager(16, BS, 64, host_tier=tier, offload_store="full", group_windows=[0, 4])
    a = req("a", A)
    admit(kv, a)
    assert end_step(kv) is None  # stored by the plan after the one computing them
    copies = end_step(kv)
    full, sliding = kv.get_block_ids("a")
    h = HASHER.block_hashes(A)
    assert sorted(copies.store_device_ids) == sorted([*full[:4], *sliding[2:4]])
    assert sorted(tier.blocks) == sorted([keyed(h[i], 0) for i in range(4)] + [keyed(h[i], 1) for i in (2, 3)])
    kv.free(a)
    kv.check_invariants()


def test_a_claim_the_tier_does_not_back_is_refused_and_changes_nothing():
    tier = HostTier(16, BS)
    kv = KVCacheManager(16, BS, 64, host_tier=tier, group_windows=[0, 4])
    h = HASHER.block_hashes(A)
    stored(tier, [keyed(h[i], 0) for i in range(4)])  # no sliding block at all
    a = req("a", A)
    hits, n = kv.get_computed_blocks(a, record_stats=False)
    assert n == 0
    with pytest.raises(ValueError, match="host-tier hit blocks claimed, the tier holds fewer"):
        kv.allocate_slots(a, 1, 8, hits)
    assert kv.get_block_ids("a") == ([], []) and tier.num_pinned_blocks == 0
    kv.check_invariants()


def test_the_tiers_cpu_events_name_the_hash_and_the_group_as_the_pools_do():
    from protocol.kv_events import MEDIUM_CPU
    from scheduler.core.kv_events import BlockStored, KVEventRecorder

    events = KVEventRecorder()
    tier = HostTier(16, BS, event_sink=events)
    kv = KVCacheManager(16, BS, 64, host_tier=tier, offload_store="full", group_windows=[0, 4], event_sink=events)
    admit(kv, req("a", A))
    end_step(kv)
    end_step(kv)  # the write-through stores complete
    cpu = [(e.block_hashes, e.group_idx, e.sliding_window) for e in events.take_events()
           if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    h = HASHER.block_hashes(A)
    # One event per group's run of the step's stores, each with the request's own hashes.
    assert sorted(cpu, key=lambda c: c[1]) == [(h[:4], 0, 0), (h[2:4], 1, 4)]
