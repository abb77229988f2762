"""The host tier alone: slots, LRU order, duplicate stores skipped, slots pinned by
copies in flight never evicted, events with medium CPU, clear()."""

from __future__ import annotations

import pytest

from protocol.kv_events import MEDIUM_CPU
from scheduler.core.kv_events import BlockRemoved, BlockStored, KVEventRecorder
from scheduler.core.offload.offload_tier import HostTier, HostTierCopies
from scheduler.core.retention.lru_policy import LRUPolicy


def h(i: int) -> bytes:
    return bytes([i]) * 32


def store(tier: HostTier, i: int, device_id: int) -> int | None:
    """Store h(i) from device block ``device_id`` in this step's plan: the slot it
    got, or None (skipped: the tier holds it already; dropped: no slot)."""
    num_stores = tier.num_stores
    tier.prepare_stores([(device_id, h(i))])
    return tier.blocks[h(i)].slot if tier.num_stores > num_stores else None


def stored(tier: HostTier, *hashes: int, device_id: int = 5) -> None:
    """Store ``hashes`` in one step, and complete it."""
    for i in hashes:
        assert store(tier, i, device_id) is not None
    tier.take_copies()
    tier.complete_copies()
    tier.check_invariants()


def test_lru_policy_order_and_errors():
    p = LRUPolicy()
    for i in (1, 2, 3):
        p.insert(h(i))
    p.remove(h(2))
    p.insert(h(2))  # back as the most recent
    assert list(p) == [h(1), h(3), h(2)]
    assert p.evict() == h(1) and p.evict() == h(3) and p.evict() == h(2) and p.evict() is None
    with pytest.raises(ValueError, match="not evictable"):
        p.remove(h(9))
    p.insert(h(4))
    with pytest.raises(ValueError, match="already evictable"):
        p.insert(h(4))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostTier(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        HostTier(4, 0)


def test_stores_fill_slots_from_0_then_evict_least_recently_used():
    tier = HostTier(3, 4)
    # A store names device block -> slot, stores first in the plan.
    assert store(tier, 1, 7) == 0
    assert store(tier, 2, 8) == 1
    assert tier.take_copies() == HostTierCopies([7, 8], [0, 1], [], [])
    tier.complete_copies()
    stored(tier, 3)
    # slots: 0=h1 1=h2 2=h3, LRU order h1, h2, h3; a load of h1 makes it the most recent.
    entries = tier.pin([h(1)])
    tier.add_loads(entries, [9])
    assert tier.take_copies() == HostTierCopies([], [], [0], [9])
    tier.complete_copies()
    assert list(tier.policy) == [h(2), h(3), h(1)]
    # Full: the next store evicts h2 and reuses its slot.
    assert store(tier, 4, 6) == 1
    assert h(2) not in tier.blocks and tier.num_evictions == 1
    tier.check_invariants()


def test_a_store_of_a_hash_held_is_skipped_and_counted():
    tier = HostTier(4, 4)
    stored(tier, 1)
    assert store(tier, 1, 3) is None
    assert tier.num_stores_skipped == 1 and tier.num_stores == 1
    # Also while its own store is still in this step's plan.
    assert store(tier, 2, 3) == 1
    assert store(tier, 2, 4) is None
    assert tier.num_stores_skipped == 2
    assert tier.take_copies() == HostTierCopies([3], [1], [], [])
    tier.check_invariants()


def test_slots_being_loaded_or_stored_are_never_evicted():
    tier = HostTier(2, 4)
    stored(tier, 1, 2)
    # h1 is loaded in this step: pinned. h3's store evicts h2, the only evictable one.
    tier.add_loads(tier.pin([h(1)]), [5])
    assert store(tier, 3, 6) == 1
    # Now h1 is pinned (load) and h3 not ready (store): nothing can be evicted.
    assert store(tier, 4, 7) is None
    assert tier.num_stores_dropped == 1
    assert tier.get_usage() == 1.0  # every slot pinned
    tier.check_invariants()
    copies = tier.take_copies()
    # Still pinned while the plan is in flight.
    assert store(tier, 4, 7) is None
    tier.complete_copies()
    assert copies == HostTierCopies([6], [1], [0], [5])
    assert tier.get_usage() == 0.0 and tier.num_cached_blocks == tier.num_host_blocks
    # One step stored h3 and read h1: the read counts as the later use, h3 goes.
    assert store(tier, 4, 7) == 1 and h(1) in tier.blocks
    tier.check_invariants()


def test_a_pending_store_is_a_hit_in_the_same_plan_and_stays_pinned_until_complete():
    tier = HostTier(2, 4)
    assert store(tier, 1, 3) == 0
    # Stores run before loads in one plan: the hash can be loaded in the same step.
    assert tier.lookup([h(1), h(2)]) == 1
    tier.add_loads(tier.pin([h(1)]), [4])
    assert tier.take_copies() == HostTierCopies([3], [0], [0], [4])
    tier.check_invariants()
    assert not tier.blocks[h(1)].is_ready and tier.blocks[h(1)].ref_cnt == 1
    tier.complete_copies()
    entry = tier.blocks[h(1)]
    assert entry.is_ready and entry.ref_cnt == 0 and h(1) in tier.policy
    tier.check_invariants()


def test_pin_of_a_missing_hash_pins_nothing():
    tier = HostTier(2, 4)
    stored(tier, 1)
    with pytest.raises(KeyError):
        tier.pin([h(1), h(2)])
    assert tier.blocks[h(1)].ref_cnt == 0
    tier.check_invariants()


def test_events_have_medium_cpu_like_vllms_offloading_connector():
    rec = KVEventRecorder()
    tier = HostTier(1, 4, event_sink=rec)
    store(tier, 1, 3)
    assert rec.take_events() == []  # announced when the store completed, not before
    tier.take_copies()
    tier.complete_copies()
    assert rec.take_events() == [BlockStored([h(1)], None, [], 4, MEDIUM_CPU)]
    stored(tier, 2)
    assert rec.take_events() == [BlockRemoved([h(1)], MEDIUM_CPU), BlockStored([h(2)], None, [], 4, MEDIUM_CPU)]
    store(tier, 3, 3)  # evicts h2 (removed now)
    tier.clear()
    # h3's store never completed, so it was never announced: clear() removes nothing more.
    assert rec.take_events() == [BlockRemoved([h(2)], MEDIUM_CPU)]


def test_clear_forgets_entries_and_copies_in_flight():
    tier = HostTier(3, 4)
    stored(tier, 1, 2)
    tier.add_loads(tier.pin([h(1)]), [4])
    store(tier, 3, 5)
    tier.take_copies()
    tier.clear()
    tier.check_invariants()
    assert tier.num_cached_blocks == 0 and tier.lookup([h(1)]) == 0 and tier.take_copies() is None
    tier.complete_copies()  # the result of the plan in flight comes in: nothing to do
    assert tier.take_copies() is None
    assert store(tier, 1, 4) == 0
    tier.check_invariants()
