"""ResidencyBlockPool: vLLM's KV residency observations (lifetime, idle before
evict, reuse gaps) on a fake clock, and the pool's behaviour unchanged by them.

Free queue drawn front first; ``*`` marks a block holding a hash."""

from __future__ import annotations

import random

import pytest
from kvtest.kv_manager import BS, admit, req, snapshot

from scheduler.core.block_pool import BlockPool
from scheduler.core.block_residency import (
    MAX_ACCESS_HISTORY,
    ResidencyBlockPool,
    residency_pool_factory,
)
from scheduler.core.kv_cache_manager import KVCacheManager


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def hashes(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(n)]


def test_lifetime_idle_and_reuse_gaps_of_evicted_blocks():
    clock = Clock()
    pool = ResidencyBlockPool(5, clock=clock)
    a, b = pool.get_new_blocks(2)  # t=0: blocks 1 and 2
    pool.cache_full_blocks([a, b], hashes(2), 0, 2)
    pool.free_blocks([b, a])
    # head -> 3 -> 4 -> 2* -> 1* -> tail
    for t in (1.0, 3.5, 4.0):  # three hits on block 1
        clock.now = t
        pool.touch([a])
        pool.free_blocks([a])
    pool.check_invariants()
    assert pool.take_residency().lifetimes == []  # nothing evicted yet
    clock.now = 10.0
    pool.get_new_blocks(4)  # every block: 1 and 2 lose their tenancy
    s = pool.take_residency()
    assert sorted(s.lifetimes) == [10.0, 10.0]
    assert sorted(s.idle_before_evict) == [6.0, 10.0]  # block 1 last hit at 4.0
    assert s.reuse_gaps == [2.5, 0.5]  # between hits, not from the allocation
    assert pool.take_residency().lifetimes == []  # taken once


def test_reuse_gaps_come_from_the_last_hits_only():
    clock = Clock()
    pool = ResidencyBlockPool(3, clock=clock)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], hashes(1), 0, 1)
    pool.free_blocks([a])
    for t in (1.0, 2.0, 4.0, 8.0, 16.0, 32.0):
        clock.now = t
        pool.touch([a])
        pool.free_blocks([a])
    clock.now = 40.0
    pool.get_new_blocks(2)
    # Hits at 1, 2, 4, 8, 16, 32: the last four are remembered, so three gaps.
    assert MAX_ACCESS_HISTORY == 4
    assert pool.take_residency().reuse_gaps == [4.0, 8.0, 16.0]


def test_an_unhashed_block_reused_is_an_eviction_too_as_in_vllm():
    clock = Clock()
    pool = ResidencyBlockPool(3, clock=clock)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])  # no hash: back to the front
    clock.now = 2.0
    assert pool.get_new_blocks(1) == [a]
    s = pool.take_residency()
    assert s.lifetimes == [2.0] and s.idle_before_evict == [2.0] and s.reuse_gaps == []


def test_caching_off_observes_nothing():
    clock = Clock()
    pool = ResidencyBlockPool(3, enable_caching=False, clock=clock)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    clock.now = 1.0
    pool.get_new_blocks(2)
    assert pool.take_residency().lifetimes == []


def test_sampling_tracks_only_the_drawn_allocations():
    draws = iter([0.1, 0.9, 0.2, 0.9, 0.9, 0.9])  # below 0.5: tracked
    clock = Clock()
    pool = ResidencyBlockPool(4, clock=clock, sample_rate=0.5, rng=lambda: next(draws))
    blocks = pool.get_new_blocks(3)  # blocks 1 and 3 tracked, 2 not
    pool.free_blocks(blocks[::-1])
    clock.now = 5.0
    pool.get_new_blocks(3)
    assert pool.take_residency().lifetimes == [5.0, 5.0]


def test_reset_prefix_cache_forgets_every_block():
    clock = Clock()
    pool = ResidencyBlockPool(3, clock=clock)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([a], hashes(1), 0, 1)
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    clock.now = 1.0
    pool.get_new_blocks(2)
    assert pool.take_residency().lifetimes == []


@pytest.mark.parametrize("rate", [0.0, -0.1, 1.5])
def test_a_sample_rate_outside_zero_to_one_is_refused(rate):
    with pytest.raises(ValueError, match="sample_rate"):
        ResidencyBlockPool(3, sample_rate=rate)
    with pytest.raises(ValueError, match="sample_rate"):
        residency_pool_factory(rate)


@pytest.mark.parametrize("seed", range(3))
def test_the_pool_behaves_exactly_as_the_plain_one(seed):
    """Same operations on both pools: same blocks, queue, hashes and counters."""
    rng = random.Random(seed)
    plain = KVCacheManager(24, BS, 64)
    watched = KVCacheManager(24, BS, 64, pool_factory=residency_pool_factory())
    assert type(watched.block_pool) is ResidencyBlockPool and type(plain.block_pool) is BlockPool
    prefixes = [[rng.randrange(2, 50) for _ in range(8)] for _ in range(3)]
    live: list[str] = []
    for i in range(200):
        if live and (rng.random() < 0.4 or len(live) > 4):
            rid = live.pop(rng.randrange(len(live)))
            for m in (plain, watched):
                m.free(type("R", (), {"request_id": rid, "alloc_noop_until": 0})())
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(2, 50) for _ in range(rng.randrange(1, 9))]
            got = [admit(m, req(f"r{i}", tokens)) for m in (plain, watched)]
            assert (got[0][1] is None) == (got[1][1] is None)
            if got[0][1] is not None:
                live.append(f"r{i}")
        assert snapshot(plain) == snapshot(watched)
    watched.check_invariants()
    assert watched.block_pool.take_residency().lifetimes  # it did observe


def test_the_factory_builds_a_pool_with_its_sample_rate():
    m = KVCacheManager(8, BS, 64, enable_caching=False, pool_factory=residency_pool_factory(0.25))
    assert type(m.block_pool) is ResidencyBlockPool
    assert m.block_pool.sample_rate == 0.25 and m.block_pool.enable_caching is False
