"""Which sliding-window blocks get a hash, by hand (vLLM 0.32 serve's default,
prefix_cache_retention_interval 0): block size 2, a full group (0) and a sliding
group (1) of window 4, so a sliding hit needs the cdiv(4 - 1, 2) = 2 blocks ending at
its length, and only those 2-block tails are hashed that end at the replay boundary
(num_prompt_tokens - 1, floored to a block) or at the request's shared-prefix junction."""

from __future__ import annotations

from scheduler.core.hashing import BlockHasher
from scheduler.core.hybrid.sliding_window_retention import retained_block_runs
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.single_type_kv_cache_manager import group_key
from scheduler.sched.request import Request

BS = 2
HASHER = BlockHasher(BS)


def req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), max_tokens=16, block_hasher=HASHER)


def num_keys(m: KVCacheManager, group: int) -> int:
    suffix = group_key(group)
    return sum(k.endswith(suffix) for k in m.block_pool.cached_block_hash_to_block.keys())


def hashed(m: KVCacheManager, rid: str, group: int) -> list[int]:
    """Indices of the request's table in ``group`` whose block holds a hash."""
    table = m.coordinator.single_type_managers[group].req_to_blocks[rid]
    return [i for i, b in enumerate(table) if not b.is_null and b.block_hash is not None]


def run(m: KVCacheManager, r: Request, chunk: int) -> int:
    """Admit ``r`` (its hit) and compute its prompt in chunks; returns the hit."""
    hits, n = m.get_computed_blocks(r)
    first = min(chunk, r.num_tokens - n)
    assert m.allocate_slots(r, first, n, hits) is not None
    r.num_computed_tokens = n + first
    while r.num_computed_tokens < r.num_tokens:
        step = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert m.allocate_slots(r, step) is not None
        r.num_computed_tokens += step
    m.check_invariants()
    return n


def test_the_runs_are_the_tails_ending_at_each_boundary_floored_to_a_block():
    # Boundary 9: block 4 ends at it, the tail is blocks 2, 3.
    assert retained_block_runs(0, 10, 2, [9], 2) == [(2, 4)]
    # Tails 3..4 (10) and 4..5 (13) overlap: one run, whatever the boundaries' order.
    assert retained_block_runs(0, 10, 2, [13, 10], 2) == [(3, 6)]
    # Apart: two runs, ascending.
    assert retained_block_runs(0, 10, 2, [9, 3], 2) == [(0, 1), (2, 4)]
    # Only within [start, end): blocks already passed or not yet full are left out.
    assert retained_block_runs(3, 5, 2, [9], 2) == [(3, 4)]
    assert retained_block_runs(4, 10, 2, [9], 2) == []
    # No junction (0), or a window of one token (a hit needs no block): nothing.
    assert retained_block_runs(0, 10, 2, [0], 2) == []
    assert retained_block_runs(0, 10, 0, [9], 2) == []


def test_chunks_cache_the_same_sliding_tail_as_the_whole_prompt():
    prompt = range(14)  # replay boundary 13: the sliding tail is blocks 4, 5
    for chunk in (14, 3, 1):
        m = KVCacheManager(40, BS, 64, group_windows=[0, 4])
        a = req("a", prompt)
        run(m, a, chunk)
        # (By one token at a time the window has already freed block 4 -- hashed.)
        assert hashed(m, "a", 0) == list(range(7)) and hashed(m, "a", 1)[-1:] == [5], chunk
        assert (num_keys(m, 0), num_keys(m, 1)) == (7, 2)
        m.free(a)
        # A resend hits 13 tokens at most: 6 blocks, the sliding group's last two.
        hits, n = m.get_computed_blocks(req("b", prompt))
        assert n == 12 and list(hits.get_block_ids())[1][:4] == [0, 0, 0, 0], chunk


def test_decoding_past_the_prompt_hashes_full_blocks_only():
    m = KVCacheManager(40, BS, 64, group_windows=[0, 4])
    a = req("a", range(5))  # replay boundary 4: sliding blocks 0, 1
    run(m, a, 5)
    for token in range(100, 107):
        a.append_output_token_ids([token])
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    # 12 tokens: full caches its 6 full blocks, sliding kept its 2 (freed, still hashed).
    assert (num_keys(m, 0), num_keys(m, 1)) == (6, 2)
    assert list(m.get_block_ids("a"))[1][:4] == [0, 0, 0, 0]


def test_a_resumed_request_caches_the_tail_at_its_junction():
    m = KVCacheManager(40, BS, 64, group_windows=[0, 4])
    a = req("a", range(5))
    run(m, a, 5)
    for token in range(100, 105):
        a.append_output_token_ids([token])
        assert m.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    m.free(a)  # preempted with 10 tokens: full blocks 0..4 hashed, sliding 0, 1
    a.num_computed_tokens = 0
    a.num_preemptions += 1
    # Its lookup (9 tokens at most, 4 blocks): full hits 8 tokens, the sliding group
    # only blocks 0, 1 (its prompt's tail): 4. Full ran 4 further: junction at 8.
    n = run(m, a, 10)
    assert n == 4 and m.coordinator.shared_prefix_boundary == {"a": 8}
    # Recomputed: the tail ending at the junction (blocks 2, 3) is hashed now; block 4
    # (past both boundaries) is not.
    assert hashed(m, "a", 1) == [0, 1, 2, 3]
    assert num_keys(m, 1) == 4
    # So the next request on the same 10 tokens hits all four full blocks it may.
    hits, n = m.get_computed_blocks(req("b", [*range(5), *range(100, 105)]))
    assert n == 8 and list(hits.get_block_ids())[1][:2] == [0, 0]
    m.free(a)
    assert m.coordinator.shared_prefix_boundary == {}


def test_the_junction_is_set_by_a_lookup_at_admission_only():
    m = KVCacheManager(40, BS, 64, group_windows=[0, 4])
    a = req("a", range(10))  # sliding tail: blocks 2, 3
    run(m, a, 10)
    m.free(a)
    # Full hits 5 blocks of b, the sliding group's last two are 2, 3: 8 tokens.
    b = req("b", [*range(10), *range(50, 56)])
    hits, n = m.get_computed_blocks(b)
    assert n == 8 and m.coordinator.shared_prefix_boundary == {"b": 10}
    # A request that skips the prefix cache: no lookup, so no junction.
    b.skip_reading_prefix_cache = True
    hits, n = m.get_computed_blocks(b)
    assert n == 0 and not hits and m.coordinator.shared_prefix_boundary == {}
    b.skip_reading_prefix_cache = False
    n = run(m, b, 16)
    assert n == 8 and m.coordinator.shared_prefix_boundary == {"b": 10}
    # Sliding: the hits 2, 3 (a's), then b's own tails: 3, 4 at the junction 10, 5, 6
    # at the replay boundary 15; its block 7 (full too) in neither.
    assert hashed(m, "b", 1) == [2, 3, 4, 5, 6]
    # A lookup for a request holding blocks (a probe) leaves its junction alone.
    m.get_computed_blocks(req("b", range(12)))
    assert m.coordinator.shared_prefix_boundary == {"b": 10}
