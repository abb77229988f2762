"""The device pool's eviction policies (scheduler/core/*_policy.py, policy_free_queue.py).

Random request workloads drive each policy's pool with invariants checked after
every operation; hand-worked cases pin down each policy's order. Expected orders
come from the policies' definitions (their module docstrings), worked by hand in
the comments.
"""

from __future__ import annotations

import random

import pytest

from scheduler.core.block_pool import BlockPool
from scheduler.core.retention.block_policy import LRUBlockPolicy
from scheduler.core.retention.eviction_policies import (
    KV_EVICTION_POLICIES,
    eviction_pool_factory,
    kv_cache_manager_class,
)
from scheduler.core.retention.policy_free_queue import policy_pool_factory
from scheduler.core.retention.priority_retention import PriorityBlockPolicy


def chain(family: str, n: int, shared: int = 0, root: str = "sys") -> list[bytes]:
    """Block hashes of a prompt of ``n`` blocks, the first ``shared`` from ``root``."""
    return [(f"{root}:{k}" if k < shared else f"{family}:{k}").encode() for k in range(n)]


class Driver:
    """Requests over a bare pool, as the manager drives it: hits touched, new blocks
    allocated and cached, a row freed last block first."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.rows: dict[int, list] = {}
        self.next_id = 0
        self.handed_out: list[int] = []

    def admit(self, hashes: list[bytes]) -> int | None:
        pool = self.pool
        hits = []
        for h in hashes:
            block = pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        num_new = len(hashes) - len(hits)
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new > pool.get_num_free_blocks() - num_free_hits:
            return None
        pool.touch(hits)
        new = pool.get_new_blocks(num_new)
        self.handed_out += [b.block_id for b in new]
        row = hits + new
        pool.cache_full_blocks(row, hashes, len(hits), len(hashes))
        rid = self.next_id
        self.next_id += 1
        self.rows[rid] = row
        return rid

    def finish(self, rid: int) -> None:
        self.pool.free_blocks(self.rows.pop(rid)[::-1])

    def cached(self, hashes: list[bytes]) -> int:
        return sum(self.pool.get_cached_block(h) is not None for h in hashes)


def random_run(pool: BlockPool, seed: int, steps: int = 300) -> Driver:
    rng = random.Random(seed)
    d = Driver(pool)
    for _ in range(steps):
        if d.rows and (rng.random() < 0.45 or len(d.rows) > 4):
            d.finish(rng.choice(list(d.rows)))
        else:
            fam = rng.randrange(12)
            d.admit(chain(f"f{fam}", rng.randrange(1, 7), shared=rng.randrange(0, 3), root=f"s{fam % 2}"))
        pool.check_invariants()
        if rng.random() < 0.02 and not d.rows:
            assert pool.reset_prefix_cache()
            pool.check_invariants()
    for rid in list(d.rows):
        d.finish(rid)
    pool.check_invariants()
    return d


@pytest.mark.parametrize("policy", KV_EVICTION_POLICIES)
@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_random_workload_keeps_the_invariants(policy, scheduling):
    for seed in range(6):
        pool = eviction_pool_factory(policy, scheduling)(24)
        d = random_run(pool, seed)
        assert pool.get_num_free_blocks() == 23
        assert len(d.handed_out) > 0


def test_lru_is_the_plain_pool_and_the_lru_object_matches_it():
    # NOTE: lru builds the plain pool (nothing added on its path) ...
    assert eviction_pool_factory("lru") is BlockPool
    # ... and the LRU policy object, where one is needed, hands out the same blocks.
    for seed in range(10):
        plain = random_run(BlockPool(20), seed)
        policy = random_run(policy_pool_factory(LRUBlockPolicy)(20), seed)
        assert policy.handed_out == plain.handed_out


def test_uncached_free_blocks_are_reused_before_any_cached_one():
    for name in KV_EVICTION_POLICIES:
        pool = eviction_pool_factory(name)(9)
        d = Driver(pool)
        a = d.admit(chain("a", 3))
        d.finish(a)
        # 5 blocks never hashed remain: a 5-block prompt takes them and evicts nothing.
        b = d.admit(chain("b", 5))
        assert pool.num_evictions == 0 and d.cached(chain("a", 3)) == 3, name
        d.finish(b)


def test_lfu_keeps_the_block_hit_most():
    pool = eviction_pool_factory("lfu")(5)  # 4 usable blocks
    d = Driver(pool)
    d.finish(d.admit(chain("a", 2)))  # a0 a1, 0 hits
    for _ in range(2):
        d.finish(d.admit(chain("a", 1)))  # a0 hit twice
    d.finish(d.admit(chain("b", 2)))  # b0 b1, freed last
    # LRU's queue: a1, a0 (freed again after each hit), b1, b0: it would evict a1, a0.
    # LFU's buckets: 0 hits [a1, b1, b0], 2 hits [a0]: it evicts a1, b1.
    d.finish(d.admit(chain("c", 2)))
    assert pool.get_cached_block(b"a:0") is not None
    assert pool.get_cached_block(b"a:1") is None and pool.get_cached_block(b"b:1") is None
    assert pool.get_cached_block(b"b:0") is not None


def test_s3fifo_evicts_one_hit_wonders_before_a_reused_block():
    pool = eviction_pool_factory("s3fifo")(6)  # 5 usable
    d = Driver(pool)
    d.finish(d.admit(chain("a", 1)))
    d.finish(d.admit(chain("a", 1)))  # a0 hit once: moves to M when S is trimmed
    for fam in "bcd":
        d.finish(d.admit(chain(fam, 1)))
    # S = [a0*, b0, c0, d0] (a0 hit). 2 new blocks: uncached first (1 left), then
    # S's head a0 moves to M (it was hit), b0 is evicted.
    d.finish(d.admit(chain("e", 2)))
    assert pool.get_cached_block(b"a:0") is not None
    assert pool.get_cached_block(b"b:0") is None
    # b0 is in the ghost list: computed again, it joins M directly.
    d.finish(d.admit(chain("b", 1)))
    assert pool.policy._queue[pool.get_cached_block(b"b:0").block_id] == 2


def test_arc_ghost_hit_moves_the_target_and_lands_in_t2():
    pool = eviction_pool_factory("arc")(4)  # 3 usable
    d = Driver(pool)
    for fam in "abc":
        d.finish(d.admit(chain(fam, 1)))
    d.finish(d.admit(chain("d", 1)))  # evicts a0 (T1's oldest) -> B1
    assert pool.get_cached_block(b"a:0") is None and pool.policy.p == 0
    d.finish(d.admit(chain("a", 1)))  # a0 again: a ghost hit in B1
    assert pool.policy.p >= 1
    a0 = pool.get_cached_block(b"a:0")
    assert a0 in pool.policy._t2 and a0 not in pool.policy._t1


def test_cost_evicts_the_shallowest_leaf_and_never_breaks_a_chain():
    pool = eviction_pool_factory("cost")(8)  # 7 usable
    d = Driver(pool)
    d.finish(d.admit(chain("long", 4)))  # depths 0..3: only long:3 is a leaf
    d.finish(d.admit(chain("short", 2)))  # short:1 is a leaf at depth 1
    # 1 uncached free block; 2 more needed -> the shallowest leaf short:1, then
    # short:0 (a leaf once its child is gone, depth 0) before any of long's.
    d.finish(d.admit(chain("x", 3)))
    assert d.cached(chain("long", 4)) == 4
    assert d.cached(chain("short", 2)) == 0
    # Next: x's chain (leaf x:2 at depth 2) goes before long:3 (depth 3), and an
    # ancestor never goes before its descendants.
    d.finish(d.admit(chain("y", 1)))
    assert pool.get_cached_block(b"x:2") is None and d.cached(chain("long", 4)) == 4


def test_priority_retention_evicts_the_lower_priority_requests_blocks_first():
    class Req:
        def __init__(self, rid, hashes, priority):
            self.request_id, self.block_hashes, self.priority = rid, hashes, priority
            self.all_token_ids = list(range(4 * len(hashes)))
            self.num_computed_tokens, self.num_preemptions = 0, 0
            self.skip_reading_prefix_cache, self.alloc_noop_until = False, 0

        @property
        def num_tokens(self):
            return len(self.all_token_ids)

    manager = kv_cache_manager_class("priority")(5, 4, 64, pool_factory=eviction_pool_factory("lru", "priority"))
    assert isinstance(manager.block_pool.policy, PriorityBlockPolicy)
    high, low = Req("high", chain("h", 2), 0), Req("low", chain("l", 2), 5)
    for r in (low, high):  # low freed first: LRU alone would evict it first anyway
        manager.allocate_slots(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
    manager.free(high)  # ... so free high first: LRU would now evict high's blocks first
    manager.free(low)
    new = Req("new", chain("n", 2), 0)
    manager.allocate_slots(new, new.num_tokens)
    manager.check_invariants()
    pool = manager.block_pool
    assert pool.get_cached_block(b"h:0") is not None and pool.get_cached_block(b"h:1") is not None
    assert pool.get_cached_block(b"l:0") is None and pool.get_cached_block(b"l:1") is None


def test_a_policy_composes_with_the_residency_pool_of_kv_cache_metrics():
    from scheduler.core.block_residency import ResidencyBlockPool, residency_pool_factory

    pool = eviction_pool_factory("arc", base=residency_pool_factory(1.0))(20)
    assert isinstance(pool, ResidencyBlockPool)
    random_run(pool, 1)  # invariants after every operation
    assert pool.num_evictions > 0 and len(pool.take_residency().lifetimes) > 0
