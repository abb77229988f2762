"""Property-based test: the KVCacheManager under random requests — admitted with
their prefix hits, grown a token at a time, preempted when they do not fit, freed,
reset — with the manager's invariants and every block table checked after each
operation, and everything free at the end."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request

BLOCK_SIZE = 4
MAX_MODEL_LEN = 40


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ManagerMachine(RuleBasedStateMachine):
    """Requests admitted, grown one token at a time and freed, as a scheduler would:
    after admission (or a decode step) the step's tokens count as computed and one
    output token is appended, so ``num_tokens == num_computed_tokens + 1`` while it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.running: dict[str, Request] = {}
        self.next_id = 0

    @initialize(num_blocks=st.integers(2, 16), enable_caching=st.booleans())
    def make_manager(self, num_blocks, enable_caching):
        self.manager = KVCacheManager(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, enable_caching=enable_caching)

    def snapshot(self):
        pool = self.manager.block_pool
        return (
            [b.block_id for b in pool.free_block_queue],
            [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
            sorted((k, b.block_id) for k, b in pool.cached_block_hash_to_block.items()),
            {k: list(v) for k, v in self.manager.req_to_blocks.items()},
            dict(self.manager.coordinator.num_cached_block),
        )

    def check_table(self, req: Request, num_scheduled: int) -> None:
        """The table covers every scheduled token; its full, final blocks carry the
        request's own hashes."""
        m = self.manager
        blocks = m.req_to_blocks[req.request_id]
        assert len(blocks) == cdiv(min(num_scheduled, MAX_MODEL_LEN), BLOCK_SIZE)
        if m.enable_caching:
            num_full = min(num_scheduled, req.num_tokens) // BLOCK_SIZE
            assert m.coordinator.num_cached_block[req.request_id] == num_full
            for i in range(num_full):
                assert blocks[i].block_hash == req.block_hashes[i]
            for b in blocks[num_full:]:
                assert b.block_hash is None
        else:
            assert all(b.block_hash is None for b in blocks)

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20),
        salt=st.sampled_from([None, None, "a"]),
    )
    def admit(self, prompt, salt):
        m = self.manager
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(rid, prompt, max_tokens=100, cache_salt=salt, block_hasher=self.hasher)
        hits, num_hit_tokens = m.get_computed_blocks(req)
        assert num_hit_tokens == len(hits) * BLOCK_SIZE < req.num_tokens
        for i, b in enumerate(hits.blocks[0]):
            assert b.block_hash == req.block_hashes[i]
        before = self.snapshot()
        new = m.allocate_slots(req, req.num_tokens - num_hit_tokens, num_hit_tokens, hits)
        if new is None:
            assert self.snapshot() == before, "a refused admission changed the pool"
            need = cdiv(req.num_tokens, BLOCK_SIZE) - len(hits)
            assert need > m.block_pool.get_num_free_blocks() - sum(b.ref_cnt == 0 for b in hits.blocks[0])
            return
        assert m.req_to_blocks[rid][: len(hits)] == hits.blocks[0]
        self.check_table(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_id(len(prompt) % 3)
        self.running[rid] = req

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100), token=st.integers(0, 2))
    def decode(self, which, token):
        m = self.manager
        rid = sorted(self.running)[which % len(self.running)]
        req = self.running[rid]
        if req.num_tokens >= MAX_MODEL_LEN:
            m.free(self.running.pop(rid))
            return
        before = self.snapshot()
        new = m.allocate_slots(req, 1)
        if new is None:
            assert self.snapshot() == before, "a refused decode step changed the pool"
            # Preempted, as the scheduler would.
            m.free(self.running.pop(rid))
            return
        self.check_table(req, req.num_computed_tokens + 1)
        req.num_computed_tokens += 1
        req.append_output_token_id(token)

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish(self, which):
        rid = sorted(self.running)[which % len(self.running)]
        self.manager.free(self.running.pop(rid))
        assert rid not in self.manager.req_to_blocks

    @rule()
    def reset_prefix_cache(self):
        m = self.manager
        ok = m.reset_prefix_cache()
        assert ok == (not self.running)
        if ok:
            assert len(m.block_pool.cached_block_hash_to_block) == 0

    @invariant()
    def consistent(self):
        if self.manager is not None:
            self.manager.check_invariants()
            assert set(self.manager.req_to_blocks) == set(self.running)

    def teardown(self):
        m = self.manager
        if m is None:
            return
        for req in list(self.running.values()):
            m.free(req)
            m.check_invariants()
        self.running.clear()
        pool = m.block_pool
        assert m.usage == 0.0
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert {b.block_id for b in pool.free_block_queue} == set(range(1, pool.num_gpu_blocks))
        assert m.req_to_blocks == {} and m.coordinator.num_cached_block == {}


ManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestKVCacheManagerRandomRequests = ManagerMachine.TestCase
