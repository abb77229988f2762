"""Property-based: the two-group machine of test_hybrid_kv_cache_manager_stateful.py (random
requests, every invariant after each step) plus pins and unpins of served prompts (a
prefix of one): a pin is all or nothing and counts as one more owner of its blocks in
every group (the manager's ref_cnt check), and while a prompt stays pinned (no unpin,
no reset) its hit at its replay length (prompt - 1, floored to a block) never shrinks,
whatever the other requests evict."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, invariant, rule

from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES
from scheduler.core.retention.pinned_blocks import PinRefused
from tests.scheduler.core.hybrid.test_hybrid_kv_cache_manager_stateful import (
    BLOCK_SIZE,
    HybridMachine,
)


class HybridPinMachine(HybridMachine):
    def __init__(self) -> None:
        super().__init__()
        # (hashes, replay length in tokens) of each prompt pinned since the last unpin or reset.
        self.pinned_hits: list[tuple[list[bytes], int]] = []

    # NOTE: pools smaller than the base machine's: the pins' worth shows under eviction.
    @initialize(num_blocks=st.integers(4, 14), window=st.sampled_from([1, 2, 3, 4, 5, 8]), sliding_first=st.booleans(),
                enable_caching=st.booleans(), policy=st.sampled_from(KV_EVICTION_POLICIES))
    def make_manager(self, num_blocks, window, sliding_first, enable_caching, policy):
        super().make_manager(num_blocks, window, sliding_first, enable_caching, policy)

    @rule(which=st.integers(0, 100), cut=st.integers(0, 24))
    def pin(self, which, cut):
        if self.m is None or not self.prompts:
            return
        prompt = self.prompts[which % len(self.prompts)][: cut or None]
        hashes = self.hasher.block_hashes(prompt)
        pinned = self.m.pinned
        before = pinned.num_pinned_blocks
        try:
            out = pinned.pin(hashes, 0.0, num_tokens=len(prompt))
        except PinRefused:
            assert pinned.num_pinned_blocks == before
            return
        if out.num_missing:
            assert out.num_blocks == 0 and pinned.num_pinned_blocks == before
            return
        assert out.num_blocks == len(hashes)
        max_length = max(0, min(len(prompt) - 1, len(hashes) * BLOCK_SIZE))
        self.pinned_hits.append((hashes, max_length))
        self.check_pinned_hits()

    @rule(which=st.integers(0, 100))
    def unpin(self, which):
        if self.m is None or not self.prompts:
            return
        self.m.pinned.unpin(self.hasher.block_hashes(self.prompts[which % len(self.prompts)]))
        # NOTE: pins are per block, not per prompt: another prompt's may be gone too.
        self.pinned_hits.clear()

    @rule()
    def reset_prefix_cache(self):
        assert self.m.reset_prefix_cache() == (not self.running)
        if not self.running:
            assert self.m.pinned.num_pinned_blocks == 0
            self.pinned_hits.clear()

    @invariant()
    def consistent(self):
        super().consistent()
        self.check_pinned_hits()

    def check_pinned_hits(self) -> None:
        for hashes, max_length in self.pinned_hits:
            hit_length = self.m.coordinator.cache_hit.find(hashes, max_length)[1]
            assert hit_length // BLOCK_SIZE == max_length // BLOCK_SIZE, (hashes, max_length, hit_length)

    def teardown(self):
        if self.m is not None:
            self.m.pinned.clear()
        super().teardown()


HybridPinMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHybridPinsRandomRequests = HybridPinMachine.TestCase
