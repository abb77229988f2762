"""Pinned prefixes (scheduler/core/retention/pinned_blocks.py): a pin is one more owner of
its blocks, so no policy evicts them; unpinning, expiry, a reset give them back.
Times are an injected clock (plain numbers)."""

from __future__ import annotations

import pytest

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES, eviction_pool_factory
from scheduler.core.retention.pinned_blocks import PinRefused
from tests.scheduler.core.retention.test_eviction_policies import Driver, chain

SYSTEM = chain("system", 4)


def manager(policy: str = "lru", num_blocks: int = 11, fraction: float = 0.5) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, 256, pool_factory=eviction_pool_factory(policy), max_pinned_fraction=fraction)


def flood(d: Driver, n: int) -> None:
    # NOTE: 5 blocks, deeper than the system prompt's 4: under cost its leaf is the shallower.
    for i in range(n):
        rid = d.admit(chain(f"u{i}", 5))
        assert rid is not None
        d.finish(rid)


@pytest.mark.parametrize("policy", KV_EVICTION_POLICIES)
def test_a_pinned_prefix_survives_a_flood_ten_times_the_pool_and_unpinned_it_does_not(policy):
    kv = manager(policy)
    d = Driver(kv.block_pool)
    d.finish(d.admit(SYSTEM))
    assert kv.pinned.pin(SYSTEM, now=0.0).num_blocks == 4
    kv.check_invariants()
    flood(d, 20)  # 100 blocks of unique prompts through the 6 unpinned ones
    kv.check_invariants()
    assert d.cached(SYSTEM) == 4
    assert all(kv.block_pool.get_cached_block(h).ref_cnt == 1 for h in SYSTEM)
    assert kv.pinned.unpin(SYSTEM).num_blocks == 4
    kv.check_invariants()
    flood(d, 20)
    assert d.cached(SYSTEM) == 0


def test_pin_is_all_or_nothing_over_cached_blocks():
    kv = manager()
    d = Driver(kv.block_pool)
    d.finish(d.admit(SYSTEM[:2]))
    out = kv.pinned.pin(SYSTEM, now=0.0)
    assert (out.num_blocks, out.num_missing) == (0, 2) and kv.pinned.num_pinned_blocks == 0
    assert kv.block_pool.get_num_free_blocks() == 10


def test_the_cap_refuses_and_pins_nothing():
    kv = manager(fraction=0.5)  # 10 usable blocks -> at most 5 pinned
    d = Driver(kv.block_pool)
    d.finish(d.admit(SYSTEM))
    other = chain("other", 2)
    d.finish(d.admit(other))
    kv.pinned.pin(SYSTEM, now=0.0)
    with pytest.raises(PinRefused, match="over the cap of 5"):
        kv.pinned.pin(other, now=0.0)
    assert kv.pinned.num_pinned_blocks == 4 and kv.pinned.num_refusals == 1
    assert kv.block_pool.get_cached_block(other[0]).ref_cnt == 0
    kv.check_invariants()
    # A prompt sharing the pinned prefix adds only its own new blocks to the count.
    longer = SYSTEM + chain("tail", 5)[4:]
    d.finish(d.admit(longer))
    assert kv.pinned.pin(longer, now=0.0).num_blocks == 5 and kv.pinned.num_pinned_blocks == 5


def test_expiry_releases_the_pin_at_its_time_and_a_repin_extends_it():
    kv = manager()
    d = Driver(kv.block_pool)
    d.finish(d.admit(SYSTEM))
    kv.pinned.pin(SYSTEM, now=100.0, ttl_s=10)
    kv.pinned.pin(SYSTEM[:2], now=105.0, ttl_s=10)  # the first two now expire at 115
    assert kv.pinned.expire(109.9) == 0
    assert kv.pinned.expire(110.0) == 2 and kv.pinned.num_pinned_blocks == 2
    kv.check_invariants()
    assert kv.pinned.expire(115.0) == 2 and kv.pinned.num_pinned_blocks == 0
    assert kv.pinned.num_expired == 4 and kv.block_pool.get_num_free_blocks() == 10
    with pytest.raises(ValueError, match="ttl_s must be a positive"):
        kv.pinned.pin(SYSTEM, now=0.0, ttl_s=0)


def test_reset_clears_the_pins_but_not_while_a_request_holds_blocks():
    kv = manager()
    d = Driver(kv.block_pool)
    d.finish(d.admit(SYSTEM))
    kv.pinned.pin(SYSTEM, now=0.0)
    kv.req_to_blocks["r"] = kv.block_pool.get_new_blocks(1)
    assert not kv.reset_prefix_cache() and kv.pinned.num_pinned_blocks == 4
    kv.block_pool.free_blocks(kv.req_to_blocks.pop("r"))
    assert kv.reset_prefix_cache()
    assert kv.pinned.num_pinned_blocks == 0 and kv.pinned.num_cleared == 4
    assert d.cached(SYSTEM) == 0 and kv.block_pool.get_num_free_blocks() == 10
    kv.check_invariants()
