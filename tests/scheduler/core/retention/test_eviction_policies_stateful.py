"""Property-based: the KVCacheManager machine of test_kv_cache_manager_stateful.py
(random admissions, decode steps, frees, resets, every invariant after each) over a
pool ordered by each --kv-eviction-policy, with or without priority retention, plus
pins and unpins of random prompts: the policies and pins keep the pool's and the
manager's invariants (a pin counts as one more owner of its blocks)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, rule

from scheduler.core.retention.eviction_policies import (
    KV_EVICTION_POLICIES,
    eviction_pool_factory,
    kv_cache_manager_class,
)
from scheduler.core.retention.pinned_blocks import PinRefused
from tests.scheduler.core.test_kv_cache_manager_stateful import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    ManagerMachine,
)


class PolicyManagerMachine(ManagerMachine):
    @initialize(num_blocks=st.integers(2, 16), enable_caching=st.booleans(), policy=st.sampled_from(KV_EVICTION_POLICIES),
                scheduling=st.sampled_from(["fcfs", "priority"]))
    def make_manager(self, num_blocks, enable_caching, policy, scheduling):
        self.manager = kv_cache_manager_class(scheduling)(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, enable_caching=enable_caching,
                                                          pool_factory=eviction_pool_factory(policy, scheduling))

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20), ttl=st.sampled_from([None, 1.0]), now=st.floats(0, 3))
    def pin(self, prompt, ttl, now):
        m = self.manager
        hashes = self.hasher.block_hashes(prompt)
        before = m.pinned.num_pinned_blocks
        try:
            out = m.pinned.pin(hashes, now, ttl)
        except PinRefused:
            assert m.pinned.num_pinned_blocks == before
            return
        if out.num_missing:
            assert out.num_blocks == 0 and m.pinned.num_pinned_blocks == before
        else:
            assert all(m.block_pool.get_cached_block(h) is not None for h in hashes)

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def unpin(self, prompt):
        self.manager.pinned.unpin(self.hasher.block_hashes(prompt))

    @rule(now=st.floats(0, 5))
    def expire(self, now):
        self.manager.pinned.expire(now)

    def teardown(self):
        if self.manager is not None:
            self.manager.pinned.clear()
        super().teardown()


PolicyManagerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
TestPolicyManagerRandomRequests = PolicyManagerMachine.TestCase
