"""Property-based test: hybrid KV-cache groups (full attention first, then a sliding window,
or full, sliding, full) over the device pool and the host tier, under random requests,
revisits, steps, aborts, resets and lost workers, driven through the real Scheduler.

Every plan is applied to the contract-checking fake worker (kvtest.fake_worker: it runs the
tier's stores and loads on its model of the KV slots and checks every read of group 0, a
full-attention group) and to a replica of the worker's per-group tables (kvtest.group_tables:
nulls only grow, never in a full group, never reach the next token's window). After every
step: the manager's invariants over both tiers (every load goes to a held block holding the
loaded keyed hash); at the end everything drains: no block held, no host slot pinned."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvtest.fake_worker import FakeWorker
from kvtest.group_tables import GroupTables

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.offload.offload_tier import HostTier
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
VOCAB = 64
PREFIXES = [[], [2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5, 6, 7, 8, 9, 2, 2, 2, 2, 3, 3, 3, 3], [9, 8, 7, 6, 5, 4, 3, 2]]


class HybridTwoTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.next_id = 0
        self.prompts: list[tuple[list[int], int]] = []

    @initialize(
        windows=st.sampled_from([[0, 5], [0, 8], [0, 12, 0], [0, 4, 9]]),
        num_blocks=st.integers(9, 20),
        num_host_blocks=st.integers(4, 40),
        offload_store=st.sampled_from(["eviction", "full"]),
        budget=st.sampled_from([5, 16, 64]),
        max_num_seqs=st.integers(1, 4),
    )
    def make(self, windows, num_blocks, num_host_blocks, offload_store, budget, max_num_seqs):
        self.tier = HostTier(num_host_blocks, BLOCK_SIZE)
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, host_tier=self.tier, offload_store=offload_store,
                                 group_windows=windows, max_num_batched_tokens=budget)
        self.sched = Scheduler(self.kv, max_num_seqs, budget, MAX_MODEL_LEN)
        self.windows, self.num_blocks, self.num_host_blocks = windows, num_blocks, num_host_blocks
        self.new_worker()

    def new_worker(self) -> None:
        self.worker = FakeWorker(self.num_blocks, BLOCK_SIZE, VOCAB, num_host_blocks=self.num_host_blocks)
        self.replica = GroupTables(len(self.windows))

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(2, 4), min_size=1, max_size=6), max_tokens=st.integers(1, 6))
    def add_request(self, prefix, tail, max_tokens):
        prompt = prefix + tail
        # Every request fits the pool alone (the scheduler's admission gate counts every group).
        if self.kv.num_blocks_needed(min(len(prompt) + max_tokens, MAX_MODEL_LEN)) > self.num_blocks - 1:
            return
        self.add(prompt, max_tokens)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data())
    def add_again(self, data):
        """A prompt seen before (a multi-turn revisit): the one case a tier serves."""
        self.add(*data.draw(st.sampled_from(self.prompts)))

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.sched.add_request(Request(f"r{self.next_id}", prompt, max_tokens, seq_id=self.next_id, ignore_eos=True,
                                       block_hasher=self.hasher))
        self.next_id += 1
        self.prompts.append((prompt, max_tokens))

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
        self.replica.apply(out.plan)
        assert set(self.replica.rows) == {r.seq_id for r in self.sched.running}
        for r in self.sched.running:
            assert self.replica.rows[r.seq_id] == list(self.kv.get_block_ids(r.request_id)), r.request_id
        self.sched.update_from_output(self.worker.execute(out.plan))

    @rule()
    def drain(self):
        """Step until every request finished: their blocks are free, cached, next to evict."""
        for _ in range(200):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
            self.kv.check_invariants()

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)

    @rule()
    def reset_prefix_cache(self):
        if self.kv.reset_prefix_cache():
            assert self.tier.num_cached_blocks == 0 and len(self.kv.block_pool.cached_block_hash_to_block) == 0

    @rule()
    def lose_the_worker(self):
        # As the engine does (scheduler/engine/worker_side.py).
        self.sched.abandon_in_flight()
        self.sched.preempt_all()
        assert self.kv.reset_prefix_cache()
        assert self.tier.num_cached_blocks == 0 and self.tier.take_copies() is None
        self.new_worker()
        self.worker.expected_step = self.sched.next_step_id
        self.worker.preempted = {r.seq_id for r in self.sched.waiting if r.status == RequestStatus.PREEMPTED}

    @invariant()
    def consistent(self):
        if not hasattr(self, "sched"):
            return
        self.kv.check_invariants()
        assert self.tier.get_usage() == 0.0  # between steps nothing is in flight

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(500):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
            self.kv.check_invariants()
        assert not self.sched.has_unfinished_requests(), "requests did not drain"
        assert self.kv.usage == 0.0 and self.tier.get_usage() == 0.0


HybridTwoTierMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_hybrid_two_tiers = HybridTwoTierMachine.TestCase
