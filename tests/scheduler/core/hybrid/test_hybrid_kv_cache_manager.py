"""KVCacheManager of two groups by hand: block size 2, one full-attention group (0) and one
sliding group (1) of window 4, so a sliding hit needs cdiv(4 - 1, 2) = 2 contiguous
blocks and the token at position p keeps blocks from position p - 3 on. The full
group caches every full block; the sliding group only the 2 blocks ending at the
replay boundary (num_prompt_tokens - 1, floored to a block) and at a shared-prefix
junction (vLLM serve's default retention; test_sliding_window_retention.py)."""

from __future__ import annotations

import pytest

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_events import BlockRemoved, KVEventRecorder
from scheduler.sched.request import Request

BS = 2
HASHER = BlockHasher(BS)


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), max_tokens=16, block_hasher=HASHER)


def queue(m) -> str:
    return " ".join(
        f"{b.block_id}*" if b.block_hash is not None else str(b.block_id)
        for b in m.block_pool.free_block_queue
    )


def admit(m, r: Request, num_new_tokens: int | None = None):
    hits, n = m.get_computed_blocks(r)
    new = m.allocate_slots(
        r, r.num_tokens - n if num_new_tokens is None else num_new_tokens, n, hits
    )
    if new is not None:
        r.num_computed_tokens = n + (r.num_tokens - n if num_new_tokens is None else num_new_tokens)
    m.check_invariants()
    return hits, n, new


def decode(m, r: Request, token: int):
    r.append_output_token_ids([token])
    new = m.allocate_slots(r, 1)
    if new is not None:
        r.num_computed_tokens += 1
    m.check_invariants()
    return new


@pytest.fixture
def m():
    return KVCacheManager(16, BS, 64, group_windows=[0, 4])


def test_the_window_frees_its_blocks_deepest_first_and_nulls_them(m):
    a = req("a", range(10))
    _, n, new = admit(m, a)
    # Five blocks per group: full 1..5, sliding 6..10; all five full. Full caches all
    # five; sliding only blocks 2, 3 (8, 9), which end at the replay boundary 9.
    assert n == 0 and list(new.get_block_ids()) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    assert [m.block_pool.blocks[i].block_hash is not None for i in range(1, 11)] == [
        *[True] * 5, False, False, True, True, False,
    ]
    assert queue(m) == "11 12 13 14 15"
    assert m.take_nulled() == []
    # Token 10 attends to positions 7..10: blocks 0..2 (positions 0..5) are wholly
    # behind; freed from the deepest (8, 7, 6): the cached 8 to the back of the queue,
    # the unhashed 7, 6 to its front, where the next two blocks come from.
    new = decode(m, a, 10)
    assert list(new.get_block_ids()) == [[7], [6]]
    assert list(m.get_block_ids("a")) == [[1, 2, 3, 4, 5, 7], [0, 0, 0, 9, 10, 6]]
    assert queue(m) == "11 12 13 14 15 8*"
    assert m.take_nulled() == [("a", 1, 3)]
    assert m.take_nulled() == []  # reported once
    assert m.usage == pytest.approx(9 / 15)


def test_a_sliding_hit_needs_only_the_window_and_pads_with_the_null_block(m):
    a = req("a", range(10))
    admit(m, a)
    decode(m, a, 10)  # as above: a's sliding 8 freed (cached), 7, 6 reused
    b = req("b", [*range(10), 100, 101, 102, 103])
    hits, n = m.get_computed_blocks(b)
    # Full attention hits a's five full blocks (the sixth differs). Within those 10
    # tokens the sliding group's block 4 (10) holds no hash; right to left, blocks 3
    # (9) and 2 (8, free but cached) are the 2 a hit needs: 8 tokens, full cut to 4.
    assert n == 8 and list(hits.get_block_ids()) == [[1, 2, 3, 4], [0, 0, 8, 9]]
    # Full attention ran 2 tokens further: b's junction is at 10.
    assert m.coordinator.shared_prefix_boundary == {"b": 10}
    new = m.allocate_slots(b, 4, n, hits)
    b.num_computed_tokens = 12
    # Two new blocks per group: 11, 12 (full) and 13, 14 (sliding); 8 taken back.
    assert list(new.get_block_ids()) == [[11, 12], [13, 14]]
    assert list(m.get_block_ids("b")) == [[1, 2, 3, 4, 11, 12], [0, 0, 8, 9, 13, 14]]
    assert [b.ref_cnt for b in m.block_pool.blocks[1:6]] == [2, 2, 2, 2, 1]
    assert queue(m) == "15"
    # b's sliding tails: blocks 3, 4 (junction 10) and 4, 5 (replay boundary 13):
    # its blocks 4 and 5 (13, 14) are hashed, as all of its full group's.
    assert m.block_pool.blocks[13].block_hash is not None
    assert m.block_pool.blocks[14].block_hash is not None
    # Two lookups counted: a's (10 tokens, no hit) and b's (14, 8 hit).
    assert (m.prefix_cache_stats.queries, m.prefix_cache_stats.hits) == (24, 8)
    # Thanks to b's junction tail, a third request on a's 10 tokens now hits them all:
    # full a's 1..5 (5 found before b's 11), sliding a's 9 and b's 13.
    hits, n = m.get_computed_blocks(req("c", [*range(10), 200, 201]), record_stats=False)
    assert n == 10 and list(hits.get_block_ids()) == [[1, 2, 3, 4, 5], [0, 0, 0, 9, 13]]
    m.check_invariants()
    # Free: group by group, each table last block first; nulls skipped; unhashed
    # blocks to the front (full 7, then sliding 6, 10), hashed to the back.
    m.free(a)
    assert queue(m) == "6 10 7 15 5*"
    m.free(b)
    m.check_invariants()
    assert m.usage == 0.0 and m.coordinator.shared_prefix_boundary == {}


def test_a_sliding_hit_without_enough_contiguous_blocks_stops_at_the_gap():
    m = KVCacheManager(16, BS, 64, group_windows=[0, 4])
    a = req("a", range(10))
    admit(m, a)
    decode(m, a, 10)
    # A resend of a's prompt hits its replay tail: 9 tokens at most, so 4 blocks; the
    # sliding group's blocks 3, 2 (9, and 8 free but cached).
    hits, n = m.get_computed_blocks(req("a2", range(10)))
    assert n == 8 and list(hits.get_block_ids()) == [[1, 2, 3, 4], [0, 0, 8, 9]]
    # head -> 11 12 13 14 15 8* -> tail: c's six blocks take them, evicting a's 8.
    c = req("c", range(50, 56))
    _, _, new = admit(m, c)
    assert list(new.get_block_ids()) == [[11, 12, 13], [14, 15, 8]] and queue(m) == ""
    m.free(c)
    m.free(a)
    # Left cached of a: full 1..5, sliding 9 (block 3) alone.
    b = req("b", range(12))
    hits, n = m.get_computed_blocks(b)
    # Full hits blocks 0..4 (10 tokens); sliding within them: 10 (block 4) holds no
    # hash, 9 (block 3) does, 8 (block 2) lost it: one block, then the gap, and
    # blocks 1, 0 were never hashed: no hit at all, so full attention's is cut to it.
    assert (n, list(hits.get_block_ids())) == (0, [[], []])
    assert m.coordinator.shared_prefix_boundary == {"b": 10}


@pytest.mark.parametrize("enable_caching", [True, False])
def test_alloc_noop_until_is_the_first_call_that_would_free(enable_caching):
    m = KVCacheManager(32, BS, 64, enable_caching, group_windows=[0, 4])
    a = req("a", range(3))
    admit(m, a)
    # 2 blocks each, room for 4 tokens; with caching 1 block cached, the next fills at
    # 4 tokens (bound 2*2 - 1 = 3). Sliding: block 0 is freed by a call at c computed
    # tokens once c - 3 >= 2, i.e. at c = 5: a call ending at <= 5 frees nothing.
    assert a.alloc_noop_until == (3 if enable_caching else 4)
    for token in range(3, 20):
        before = (list(m.get_block_ids("a")), queue(m), m.block_pool.num_evictions)
        end = a.num_computed_tokens + 1
        noop = end <= a.alloc_noop_until
        decode(m, a, token)
        if noop:
            assert (list(m.get_block_ids("a")), queue(m), m.block_pool.num_evictions) == before, token
            assert m.take_nulled() == []
    # 20 tokens computed, the 21st... blocks 0..7 of the sliding table nulled (positions < 17).
    assert list(m.get_block_ids("a"))[1][:8] == [0] * 8 and 0 not in list(m.get_block_ids("a"))[1][8:]


def test_the_admission_cap_counts_a_sliding_group_as_vllm():
    # Window 4, 4 tokens in flight: a sliding table never holds more than
    # cdiv(4 - 1 + 4, 2) + 1 = 5 blocks. A 20-token request needs 10 full blocks + 5.
    r = req("r", range(20))
    small = KVCacheManager(15, BS, 64, group_windows=[0, 4], max_num_batched_tokens=4)  # 14 usable
    assert small.allocate_slots(r, 4, full_sequence_must_fit=True) is None
    fits = KVCacheManager(16, BS, 64, group_windows=[0, 4], max_num_batched_tokens=4)  # 15 usable
    assert list(fits.allocate_slots(r, 4, full_sequence_must_fit=True).get_block_ids()) == [
        [1, 2],
        [3, 4],
    ]


def test_events_carry_the_raw_hash_and_the_group_as_vllm():
    rec, ref = KVEventRecorder(), KVEventRecorder()
    m = KVCacheManager(16, BS, 64, group_windows=[0, 4], event_sink=rec)
    one = KVCacheManager(16, BS, 64, event_sink=ref)
    a, a1 = req("a", range(5)), req("a", range(5))
    admit(m, a)
    one.allocate_slots(a1, 5)
    (single,) = ref.take_events()
    full, sliding = rec.take_events()
    assert (full.block_hashes, full.token_ids, full.group_idx, full.sliding_window) == (
        single.block_hashes,
        [0, 1, 2, 3],
        0,
        0,
    )
    assert (sliding.block_hashes, sliding.group_idx, sliding.sliding_window) == (
        single.block_hashes,
        1,
        4,
    )
    # Freed: head -> 6 3 7 8 .. 15 2* 1* 5* 4* -> tail (full 1, 2 and sliding 4, 5 hold
    # hashes 0, 1). Fourteen blocks evict 2, 1 and 5: each event names its group.
    m.free(a)
    admit(m, req("z", range(100, 114)))
    h0, h1 = single.block_hashes
    removed = [(e.block_hashes, e.group_idx) for e in rec.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [([h1], 0), ([h0], 0), ([h1], 1)]
    assert queue(m) == "4*"


def test_one_sliding_group_alone():
    m = KVCacheManager(16, BS, 64, group_windows=[4])
    a = req("a", range(9))
    admit(m, a)
    assert list(m.get_block_ids("a")) == [[1, 2, 3, 4, 5]]
    # Replay boundary 8: blocks 2, 3 (3, 4) cached, blocks 0, 1 not.
    decode(m, a, 9)  # token 9 keeps positions 6..9: blocks 0..2 freed, deepest first
    assert list(m.get_block_ids("a")) == [[0, 0, 0, 4, 5]]
    assert queue(m) == "2 1 6 7 8 9 10 11 12 13 14 15 3*"
    # One group: no other group's hit to lag behind, so never a junction.
    hits, n = m.get_computed_blocks(req("b", [*range(8), 50, 51]))
    assert n == 8 and list(hits.get_block_ids()) == [[0, 0, 3, 4]]
    assert m.coordinator.shared_prefix_boundary == {}


def test_bad_input_is_refused_by_name(m):
    assert KVCacheManager(16, BS, 64, group_windows=[]).num_groups == 1  # (): one full-attention group
    with pytest.raises(ValueError, match="group_windows"):
        KVCacheManager(16, BS, 64, group_windows=[0, -1])
    a = req("a", range(6))
    with pytest.raises(ValueError, match="beyond its device hits, but there is no host tier"):
        m.allocate_slots(a, 2, 4)
    admit(m, a)
    hits, _ = m.get_computed_blocks(req("b", range(6)))
    with pytest.raises(ValueError, match="already holds blocks"):
        m.allocate_slots(a, 1, 4, hits)


def test_priority_retention_keeps_the_higher_prioritys_blocks_in_every_group():
    from scheduler.core.retention.eviction_policies import eviction_pool_factory
    from scheduler.core.retention.priority_retention import PriorityKVCacheManager

    m = PriorityKVCacheManager(
        16, BS, 64, group_windows=[0, 4], pool_factory=eviction_pool_factory("lru", "priority")
    )
    hi, lo = req("hi", range(4)), req("lo", range(10, 14))
    lo.priority = 5
    admit(m, hi)  # full 1, 2; sliding 3, 4
    admit(m, lo)  # full 5, 6; sliding 7, 8
    m.free(hi)
    m.free(lo)
    # Sliding: only block 0 (3, 7) ends at a replay boundary (3), blocks 4, 8 unhashed.
    # Free: 4, 8, 9..15 unhashed; cached by class: 0 -> 2 1 3, 5 -> 6 5 7. Twelve
    # blocks take the nine unhashed, then all of priority 5's: priority 0's stay.
    admit(m, req("z", range(100, 112)))
    assert {b.block_id for b in m.block_pool.blocks if b.block_hash is not None} - set(
        sum(list(m.get_block_ids("z")), [])
    ) == {1, 2, 3}


def test_token_usage_counts_each_groups_held_slots(m):
    from scheduler.core.kv_cache_usage import get_num_held_tokens, get_peak_usage

    a = req("a", range(10))
    admit(m, a)
    assert get_num_held_tokens(m, [a]) == 20  # 5 full blocks in each group
    decode(m, a, 10)
    # Full: 11 tokens in 6 blocks. Sliding: positions 6..10 in 3 blocks (3 nulled).
    assert get_num_held_tokens(m, [a]) == 11 + 5
    assert get_peak_usage(m) == pytest.approx(10 / 15)


def test_residency_metrics_read_the_one_pool():
    from scheduler.core.block_residency import residency_pool_factory

    m = KVCacheManager(8, BS, 64, group_windows=[0, 4], pool_factory=residency_pool_factory())
    a = req("a", range(6))
    admit(m, a)  # 3 + 3 blocks, all cached but sliding block 2 (past the replay tail)
    m.free(a)
    admit(m, req("z", range(50, 62)))  # 6 + 6 blocks > 7: refused, nothing evicted
    assert m.block_pool.take_residency().lifetimes == []
    # 3 + 3 blocks: one never used, five of a's reused (four evicted, one unhashed).
    admit(m, req("z", range(50, 56)))
    assert len(m.block_pool.take_residency().lifetimes) == 5


def test_a_request_the_pool_can_never_hold_is_rejected_counting_every_group():
    from protocol.client_messages import Generate
    from scheduler.sched.validation import RequestLimits, RequestRejected, validate_generate

    # Window 4, 4 tokens in flight: a sliding table plateaus at 5 blocks.
    m = KVCacheManager(16, BS, 64, group_windows=[0, 4], max_num_batched_tokens=4)
    assert [m.num_blocks_needed(n) for n in (1, 8, 9, 20)] == [2, 8, 10, 15]
    limits = RequestLimits(512, 64, BS, 15, m.num_blocks_needed)
    validate_generate(
        Generate("a", list(range(2, 19)), max_tokens=4), limits, ()
    )  # 21 tokens, 20 cached: 10 + 5
    with pytest.raises(RequestRejected, match="needs 16 KV blocks but the whole pool holds 15"):
        validate_generate(
            Generate("b", list(range(2, 19)), max_tokens=6), limits, ()
        )  # 22 cached: 11 + 5
