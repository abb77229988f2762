"""Property-based test: KVCacheManager over a two-group pool (full attention
and a sliding window, either order) under random requests -- admitted with their
prefix hits whole or in chunks, grown by chunks or a token at a time, preempted,
freed, the cache reset -- with, after every step: the manager's invariants (each
block in exactly one place, ref_cnt = the tables holding it), every sliding table's
leading entries null exactly up to the window of its last call and every later
entry a block, the nulls reported once by take_nulled, hits no longer than full
attention's own and made of the request's blocks, usage from the free blocks, a
call the scheduler's fast path would skip (alloc_noop_until) changing nothing, and
which of a request's own blocks hold a hash: every full one in the full group; in
the sliding group only those of the cdiv(W - 1, 2)-block tails ending at its replay
boundary (prompt - 1) and at its junction (full attention's own hit at admission,
when longer than the hit): vLLM serve's default retention, 0."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES, eviction_pool_factory
from scheduler.core.single_type_kv_cache_manager import group_key
from scheduler.sched.request import Request

BLOCK_SIZE = 2
MAX_MODEL_LEN = 40


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager | None = None
        self.hasher = BlockHasher(BLOCK_SIZE)
        self.running: dict[str, Request] = {}
        # rid -> computed tokens at its last allocation call (what its nulls follow).
        self.called_at: dict[str, int] = {}
        # (rid, group) -> leading nulls the worker was told of (row sent, then take_nulled).
        self.told: dict[tuple[str, int], int] = {}
        # rid -> (blocks of its prefix hit, its shared-prefix junction in tokens or 0).
        self.admitted: dict[str, tuple[int, int]] = {}
        self.prompts: list[list[int]] = []
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(4, 40),
        window=st.sampled_from([1, 2, 3, 4, 5, 8]),
        sliding_first=st.booleans(),
        enable_caching=st.booleans(),
        # NOTE: every eviction policy: the pool's free queue is the policy's, whatever the groups.
        policy=st.sampled_from(KV_EVICTION_POLICIES),
    )
    def make_manager(self, num_blocks, window, sliding_first, enable_caching, policy):
        windows = [window, 0] if sliding_first else [0, window]
        self.sliding = 0 if sliding_first else 1
        self.window = window
        self.enable_caching = enable_caching
        self.m = KVCacheManager(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, enable_caching, group_windows=windows, max_num_batched_tokens=8,
                                pool_factory=eviction_pool_factory(policy))

    def snapshot(self):
        pool = self.m.block_pool
        return (
            [b.block_id for b in pool.free_block_queue],
            [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
            {rid: list(self.m.get_block_ids(rid)) for rid in self.running},
            pool.num_evictions,
        )

    def full_only_hit(self, req: Request) -> int:
        """Full attention's own hit: the longest run of its cached blocks from the start."""
        get = self.m.block_pool.cached_block_hash_to_block.get_one_block
        full = 1 - self.sliding
        n = 0
        for h in req.block_hashes[: (req.num_tokens - 1) // BLOCK_SIZE]:
            if get(h + group_key(full)) is None:
                break
            n += 1
        return n * BLOCK_SIZE

    def allocate(self, req: Request, num_new: int, num_hit: int = 0, hits=None):
        before = self.snapshot()
        noop = (
            hits is None
            and req.request_id in self.called_at
            and req.num_computed_tokens + num_new <= req.alloc_noop_until
        )
        called_at = req.num_computed_tokens + num_hit
        new = self.m.allocate_slots(req, num_new, num_hit, hits)
        if noop:
            assert self.snapshot() == before, "a call the fast path skips changed the pool"
            assert new is not None and not new
        if new is not None:
            self.called_at[req.request_id] = called_at
            req.num_computed_tokens += num_hit + num_new
        return new

    @rule(
        prompt=st.lists(st.integers(0, 2), min_size=1, max_size=24),
        chunk=st.sampled_from([1, 3, 8, 40]),
    )
    def admit(self, prompt, chunk):
        self.prompts.append(prompt)
        self.admit_prompt(prompt, chunk)

    @precondition(lambda self: self.prompts)
    @rule(
        which=st.integers(0, 100),
        cut=st.integers(0, 3),
        extra=st.lists(st.integers(0, 2), min_size=1, max_size=12),
        chunk=st.sampled_from([1, 3, 8, 40]),
    )
    def admit_extending(self, which, cut, extra, chunk):
        """A prompt sharing a prefix with an earlier one: where junctions come from."""
        earlier = self.prompts[which % len(self.prompts)]
        self.admit_prompt(earlier[: len(earlier) - cut % len(earlier)] + extra, chunk)

    def admit_prompt(self, prompt: list[int], chunk: int) -> None:
        m = self.m
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(rid, prompt, max_tokens=100, block_hasher=self.hasher)
        hits, n = m.get_computed_blocks(req)
        assert n == len(hits) * BLOCK_SIZE and n <= self.full_only_hit(req) and n < req.num_tokens
        full, sliding = hits.blocks[1 - self.sliding], hits.blocks[self.sliding]
        assert len(full) == len(sliding) == len(hits)
        for i, b in enumerate(full):
            assert b.block_hash == req.block_hashes[i] + group_key(1 - self.sliding)
        # The sliding hit: nulls, then the blocks the window of the hit's end needs.
        # NOTE: a window of one token caches no block (vLLM's reachable_block_mask): no hit.
        assert self.window > 1 or n == 0
        num_needed = min(len(sliding), cdiv(self.window - 1, BLOCK_SIZE))
        assert all(b.is_null for b in sliding[: len(sliding) - num_needed])
        for i in range(len(sliding) - num_needed, len(sliding)):
            assert sliding[i].block_hash == req.block_hashes[i] + group_key(self.sliding)
        full_hit = self.full_only_hit(req)
        if self.allocate(req, min(chunk, req.num_tokens - n), n, hits) is None:
            assert rid not in m.coordinator.single_type_managers[0].req_to_blocks
            return
        self.running[rid] = req
        self.admitted[rid] = (n // BLOCK_SIZE, full_hit if full_hit > n else 0)
        for g in range(2):
            self.told[rid, g] = m.coordinator.single_type_managers[g].num_null_blocks(
                rid
            )  # the row, sent whole

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100), chunk=st.sampled_from([1, 1, 2, 5]), token=st.integers(0, 2))
    def step(self, which, chunk, token):
        rid = sorted(self.running)[which % len(self.running)]
        req = self.running[rid]
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= MAX_MODEL_LEN:
                return self.free(rid)
            req.append_output_token_ids([token])
        if self.allocate(req, min(chunk, req.num_tokens - req.num_computed_tokens)) is None:
            self.free(rid)  # preempted, as the scheduler would

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 100))
    def finish(self, which):
        self.free(sorted(self.running)[which % len(self.running)])

    def free(self, rid: str) -> None:
        self.m.free(self.running.pop(rid))
        del self.called_at[rid]
        del self.admitted[rid]
        for g in range(2):
            self.told.pop((rid, g), None)
        assert list(self.m.get_block_ids(rid)) == [[], []]

    @rule()
    def reset_prefix_cache(self):
        assert self.m.reset_prefix_cache() == (not self.running)

    @invariant()
    def consistent(self):
        m = self.m
        if m is None:
            return
        m.check_invariants()
        pool = m.block_pool
        assert m.usage == 1 - pool.get_num_free_blocks() / (pool.num_gpu_blocks - 1)
        for rid, g, n in m.take_nulled():
            assert rid in self.running and n > self.told[rid, g]
            self.told[rid, g] = n
        for rid, req in self.running.items():
            tables = list(m.get_block_ids(rid))
            assert (
                len(tables[0])
                == len(tables[1])
                == cdiv(min(req.num_computed_tokens, MAX_MODEL_LEN), BLOCK_SIZE)
            )
            assert 0 not in tables[1 - self.sliding]
            num_null = max(0, self.called_at[rid] - self.window + 1) // BLOCK_SIZE
            sliding = tables[self.sliding]
            assert sliding[:num_null] == [0] * num_null and 0 not in sliding[num_null:], (
                self.called_at[rid],
                sliding,
            )
            assert (
                self.told[rid, self.sliding] == num_null and self.told[rid, 1 - self.sliding] == 0
            )
            self.check_hashes(req)

    def check_hashes(self, req: Request) -> None:
        """Its own blocks (past its hit; new ones never come with a hash): hashed iff
        full, and, in the sliding group, in a tail ending at a reachable boundary."""
        num_hit, junction = self.admitted[req.request_id]
        num_full = min(req.num_computed_tokens, req.num_tokens) // BLOCK_SIZE
        need = cdiv(self.window - 1, BLOCK_SIZE)
        tails = set()
        for boundary in (req.num_prompt_tokens - 1, junction):
            end = boundary // BLOCK_SIZE
            tails |= set(range(max(0, end - need), end)) if boundary else set()
        for g, m in enumerate(self.m.coordinator.single_type_managers):
            for i, b in enumerate(m.req_to_blocks[req.request_id]):
                if i < num_hit or b.is_null:
                    continue
                expected = (
                    self.enable_caching and i < num_full and (g != self.sliding or i in tails)
                )
                assert (b.block_hash is not None) == expected, (req.request_id, g, i, tails)

    def teardown(self):
        m = self.m
        if m is None:
            return
        for rid in list(self.running):
            self.free(rid)
            m.check_invariants()
        pool = m.block_pool
        assert m.usage == 0.0 and m.take_nulled() == []
        assert {b.block_id for b in pool.free_block_queue} == set(range(1, pool.num_gpu_blocks))


HybridMachine.TestCase.settings = settings(
    max_examples=80,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestHybridKVCacheManagerRandomRequests = HybridMachine.TestCase
