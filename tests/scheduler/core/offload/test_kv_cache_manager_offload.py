"""The KV cache manager with a host tier: what a step's copies say.

Eviction mode stores a hash in the plan of the step that reuses its block (stores
run first, so the copy reads the old KV); a hit found only in host memory gets a
fresh device block and a load; write-through stores a block in the plan after the
one that computes it; a reset clears both tiers."""

from __future__ import annotations

import pytest

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_blocks import KVCacheBlocks
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload.offload_tier import HostTier, HostTierCopies
from scheduler.sched.request import Request

BS = 4
HASHER = BlockHasher(BS)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, max_tokens=4, block_hasher=HASHER)


def admit(kv: KVCacheManager, r: Request) -> list[int]:
    """Admission as the scheduler does it; returns the request's block ids."""
    hits, num_hit_tokens = kv.get_computed_blocks(r, record_stats=False)
    assert kv.allocate_slots(r, r.num_tokens - num_hit_tokens, num_hit_tokens, hits) is not None
    kv.record_prefix_cache_query(r.num_tokens, num_hit_tokens, False, num_hit_tokens - len(hits) * BS)
    r.num_computed_tokens = r.num_tokens
    kv.check_invariants()
    return kv.get_block_ids(r.request_id)[0]


def end_step(kv: KVCacheManager) -> HostTierCopies | None:
    copies = kv.take_tier_copies()
    kv.complete_tier_copies()
    kv.check_invariants()
    return copies


A = list(range(10, 19))  # 9 tokens: blocks A0, A1 and a partial one
B = list(range(30, 39))


def test_an_evicted_hash_is_stored_in_the_step_that_reuses_its_block_then_loaded_on_a_hit():
    tier = HostTier(4, BS)
    kv = KVCacheManager(4, BS, 64, host_tier=tier)  # 3 usable blocks
    a_blocks = admit(kv, req("a", A))
    assert end_step(kv) is None  # nothing evicted: nothing to store
    kv.free(req("a", A))
    # B needs the whole pool: A's two hashed blocks are evicted and stored in B's step.
    b_blocks = admit(kv, req("b", B))
    copies = end_step(kv)
    assert sorted(copies.store_device_ids) == sorted(a_blocks[:2]) and not copies.load_host_ids
    # Which slot got which hash: A0's slot is the one stored from A's first block.
    a = req("a2", A)
    slot_of = dict(zip(copies.store_device_ids, copies.store_host_ids, strict=True))
    assert tier.blocks[a.block_hashes[0]].slot == slot_of[a_blocks[0]]
    assert tier.blocks[a.block_hashes[1]].slot == slot_of[a_blocks[1]]
    kv.free(req("b", B))
    # A again: the device holds neither of its blocks, the host tier both.
    hits, num_hit_tokens = kv.get_computed_blocks(a, record_stats=False)
    assert hits.blocks == ([],) and num_hit_tokens == 2 * BS
    a2_blocks = admit(kv, a)
    copies = end_step(kv)
    # Loads: host slot of A0 -> the request's first block, A1 -> its second.
    assert copies.load_host_ids == [slot_of[a_blocks[0]], slot_of[a_blocks[1]]]
    assert copies.load_device_ids == a2_blocks[:2]
    # B's hashed blocks were evicted for them: stored in the same plan, before the loads.
    assert sorted(copies.store_device_ids) == sorted(b_blocks[:2])
    # The loaded blocks are cached on the device again.
    pool = kv.block_pool
    assert [pool.blocks[i].block_hash for i in a2_blocks[:2]] == list(a.block_hashes[:2])
    # As vLLM counts them: device hits in prefix_cache_*, host hits in external_*.
    assert kv.prefix_cache_stats.hits == 0
    assert kv.external_prefix_cache_stats.queries == 3 * 9 and kv.external_prefix_cache_stats.hits == 2 * BS
    assert tier.num_stores == 4 and tier.num_loads == 2


def test_a_hash_stored_earlier_in_the_same_step_is_loaded_after_its_store():
    tier = HostTier(4, BS)
    kv = KVCacheManager(8, BS, 64, host_tier=tier)  # 7 usable blocks
    a = req("a", A)
    a_blocks = admit(kv, a)
    z, w = req("z", [50, 51]), req("w", [52, 53])
    admit(kv, z), admit(kv, w)
    end_step(kv)
    kv.free(a)
    # free queue: head -> a[2] -> 6 -> 7 -> a[1] (A1) -> a[0] (A0) -> tail
    x = req("x", list(range(60, 73)))  # 13 tokens: 4 blocks, the 4th evicts A1
    admit(kv, x)
    assert tier.lookup([a.block_hashes[1]]) == 1 and not tier.blocks[a.block_hashes[1]].is_ready
    kv.free(z), kv.free(w)  # two unhashed blocks to the front
    # Same step: A's prompt again finds A0 on the device and A1 in the host tier,
    # whose store is in this very plan (stores run before loads).
    y = req("y", A)
    hits, num_hit_tokens = kv.get_computed_blocks(y, record_stats=False)
    assert [b.block_id for b in hits.blocks[0]] == a_blocks[:1] and num_hit_tokens == 2 * BS
    y_blocks = admit(kv, y)
    copies = kv.take_tier_copies()
    slot = tier.blocks[a.block_hashes[1]].slot
    assert copies == HostTierCopies([a_blocks[1]], [slot], [slot], [y_blocks[1]])
    # In flight: the slot is pinned by the load and not ready; neither can be evicted.
    assert tier.num_pinned_blocks == 1 and tier.get_usage() == 1 / 4
    kv.complete_tier_copies()
    kv.check_invariants()
    assert tier.get_usage() == 0.0 and tier.blocks[a.block_hashes[1]].is_ready


def test_write_through_stores_a_block_in_the_plan_after_the_one_computing_it():
    tier = HostTier(4, BS)
    kv = KVCacheManager(8, BS, 64, host_tier=tier, offload_store="full")
    a = req("a", A)
    a_blocks = admit(kv, a)
    # Step 0 computes A's blocks: its plan cannot copy them yet.
    assert end_step(kv) is None
    # Step 1's plan stores them (whatever else it does).
    copies = end_step(kv)
    assert copies.store_device_ids == a_blocks[:2] and copies.store_host_ids == [0, 1]
    assert end_step(kv) is None
    # A second request with the same prefix hits the device; its blocks are not stored again.
    b = req("b", A + [1])
    admit(kv, b)
    end_step(kv)
    assert end_step(kv) is None and tier.num_stores == 2
    # Eviction does not store in this mode (the tier has them already).
    assert kv.block_pool.evicted is None


def test_reset_clears_both_tiers_and_is_refused_while_blocks_are_held():
    tier = HostTier(4, BS)
    kv = KVCacheManager(4, BS, 64, host_tier=tier)
    a = req("a", A)
    admit(kv, a)
    end_step(kv)
    kv.free(a)
    b = req("b", B)
    admit(kv, b)
    end_step(kv)
    assert tier.num_cached_blocks == 2
    assert not kv.reset_prefix_cache()
    assert tier.num_cached_blocks == 2
    kv.free(b)
    assert kv.reset_prefix_cache()
    # vLLM's CPU tier keeps serving after a reset: here nothing is found anywhere.
    assert tier.num_cached_blocks == 0
    hits, n = kv.get_computed_blocks(req("a3", A), record_stats=False)
    assert (hits.blocks, n) == (([],), 0)
    kv.check_invariants()


def test_host_hits_that_are_not_there_are_refused():
    kv = KVCacheManager(8, BS, 64)
    with pytest.raises(ValueError, match="no host tier"):
        kv.allocate_slots(req("a", A), 1, 2 * BS, KVCacheBlocks(([],)))
    tier = HostTier(4, BS)
    kv = KVCacheManager(8, BS, 64, host_tier=tier)
    with pytest.raises(ValueError, match="the tier holds fewer"):
        kv.allocate_slots(req("a", A), 1, 2 * BS, KVCacheBlocks(([],)))
    with pytest.raises(ValueError, match="multiple of the block size"):
        kv.allocate_slots(req("a", A), 1, 5, KVCacheBlocks(([],)))
    kv.check_invariants()
    with pytest.raises(ValueError, match="offload_store"):
        KVCacheManager(8, BS, 64, host_tier=tier, offload_store="sometimes")
    with pytest.raises(ValueError, match="block size"):
        KVCacheManager(8, 16, 64, host_tier=tier)
