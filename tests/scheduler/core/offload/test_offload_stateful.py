"""Property-based test over both pools: the device BlockPool and the host tier under
random requests, steps, aborts, resets and lost workers, driven through the real
Scheduler against the contract-checking fake worker (which runs every plan's
stores and loads on its model of the KV slots and checks every read).

After every step: the manager's invariants over both tiers (check_invariants);
at the end, everything drains: no block held, no host slot pinned."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvtest.fake_worker import FakeWorker

from protocol.kv_events import MEDIUM_CPU
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_events import BlockRemoved, BlockStored, KVEventRecorder
from scheduler.core.offload.offload_tier import HostTier
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
VOCAB = 64


class TwoTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.next_id = 0
        self.prompts: list[tuple[list[int], int]] = []

    @initialize(
        num_blocks=st.integers(5, 12),
        num_host_blocks=st.integers(1, 12),
        offload_store=st.sampled_from(["eviction", "full"]),
        budget=st.sampled_from([5, 16, 64]),
        max_num_seqs=st.integers(1, 4),
    )
    def make(self, num_blocks, num_host_blocks, offload_store, budget, max_num_seqs):
        self.events = KVEventRecorder()
        self.tier = HostTier(num_host_blocks, BLOCK_SIZE, event_sink=self.events)
        self.kv = KVCacheManager(
            num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, event_sink=self.events, host_tier=self.tier, offload_store=offload_store
        )
        self.sched = Scheduler(self.kv, max_num_seqs, budget, MAX_MODEL_LEN)
        self.num_blocks, self.num_host_blocks = num_blocks, num_host_blocks
        self.worker = FakeWorker(num_blocks, BLOCK_SIZE, VOCAB, num_host_blocks=num_host_blocks)
        # Hashes announced in the host tier by its events (medium CPU).
        self.cpu_hashes: set[bytes] = set()

    @rule(
        prefix=st.sampled_from([[], [2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 6, 7, 8, 9, 2, 2, 2, 2], [9, 8, 7, 6, 5, 4, 3, 2]]),
        tail=st.lists(st.integers(2, 4), min_size=1, max_size=6),
        max_tokens=st.integers(1, 6),
    )
    def add_request(self, prefix, tail, max_tokens):
        prompt = prefix + tail
        # Every request fits the pool alone (the scheduler's validation rejects more).
        if -(-min(len(prompt) + max_tokens, MAX_MODEL_LEN) // BLOCK_SIZE) > self.num_blocks - 1:
            return
        rid = f"r{self.next_id}"
        self.sched.add_request(Request(rid, prompt, max_tokens, seq_id=self.next_id, ignore_eos=True, block_hasher=self.hasher))
        self.next_id += 1
        self.prompts.append((prompt, max_tokens))

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def add_again(self, data):
        """A prompt seen before (a multi-turn revisit): the one case a tier serves."""
        prompt, max_tokens = data.draw(st.sampled_from(self.prompts))
        self.sched.add_request(Request(f"r{self.next_id}", prompt, max_tokens, seq_id=self.next_id, ignore_eos=True, block_hasher=self.hasher))
        self.next_id += 1

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            self.step()
            self.kv.check_invariants()

    def step(self):
        out = self.sched.schedule()
        if out is None:
            return
        copies = out.plan.tier_copies
        if copies is not None:
            event("a step with loads" if copies.load_host_ids else "a step with stores only")
        self.sched.update_from_output(self.worker.execute(out.plan))

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @rule()
    def reset_prefix_cache(self):
        ok = self.kv.reset_prefix_cache()
        pool = self.kv.block_pool
        assert ok == (pool.get_num_free_blocks() == pool.num_gpu_blocks - 1)
        if ok:
            # Both tiers are empty: nothing served from either after a reset.
            assert self.tier.num_cached_blocks == 0 and len(pool.cached_block_hash_to_block) == 0

    @rule()
    def lose_the_worker(self):
        # As the engine does (scheduler/engine/worker_side.py): the plan in flight is
        # abandoned, every request recomputes, both tiers' contents are void.
        self.sched.abandon_in_flight()
        self.sched.preempt_all()
        assert self.kv.reset_prefix_cache()
        assert self.tier.num_cached_blocks == 0 and self.tier.take_copies() is None
        self.worker = FakeWorker(self.num_blocks, BLOCK_SIZE, VOCAB, num_host_blocks=self.num_host_blocks)
        self.worker.expected_step = self.sched.next_step_id
        # The requests it had come back as resumed rows (sent whole).
        self.worker.preempted = {r.seq_id for r in self.sched.waiting if r.status == RequestStatus.PREEMPTED}

    @invariant()
    def both_tiers_consistent(self):
        self.kv.check_invariants()
        # Between steps nothing is in flight: no slot pinned.
        assert self.tier.get_usage() == 0.0
        for e in self.events.take_events():
            if getattr(e, "medium", None) != MEDIUM_CPU:
                continue
            if isinstance(e, BlockStored):
                assert not self.cpu_hashes & set(e.block_hashes)
                self.cpu_hashes |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.cpu_hashes
                self.cpu_hashes -= set(e.block_hashes)
        # The CPU events tell a router exactly what the tier holds.
        assert self.cpu_hashes == set(self.tier.blocks)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
            self.kv.check_invariants()
        assert not self.sched.has_unfinished_requests(), "requests did not drain"
        assert self.kv.usage == 0.0
        assert self.tier.get_usage() == 0.0  # no slot pinned: no copy in flight


TwoTierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_two_tiers = TwoTierMachine.TestCase
