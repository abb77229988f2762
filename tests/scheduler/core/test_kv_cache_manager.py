"""KVCacheManager over the BlockPool: the rules a scheduler relies on.

Block size 4 throughout; tokens are small integers. The free queue is drawn in
comments, front (reused first) on the left, ``*`` marking a block with a hash.
"""

from __future__ import annotations

from kvtest.kv_manager import BS, admit, ids, manager, queue, req, snapshot

from scheduler.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder

A8 = [1, 2, 3, 4, 5, 6, 7, 8]
A10 = A8 + [9, 10]


def test_fully_cached_prompt_still_computes_its_last_token():
    m = manager()
    r0 = req("r0", A8)
    admit(m, r0)
    m.free(r0)
    # Both of r0's blocks are cached; a prompt of exactly those 8 tokens still
    # recomputes its last token (the worker needs its logits), so 1 hit, not 2.
    r1 = req("r1", A8)
    hits, n = m.get_computed_blocks(r1)
    assert len(r1.block_hashes) == 2
    assert len(hits) == 1 and n == 4
    new = m.allocate_slots(r1, r1.num_tokens - n, n, hits)
    assert new is not None and len(new) == 1
    assert m.req_to_blocks["r1"][0] is hits.blocks[0][0]
    m.check_invariants()


def test_partial_last_block_is_never_shared():
    m = manager()
    r0 = req("r0", A10)
    _, new0 = admit(m, r0)
    assert ids(new0) == [1, 2, 3]
    # Blocks 1, 2 are full and hashed; block 3 holds 2 tokens and has no hash.
    assert [b.block_hash is not None for b in new0] == [True, True, False]
    r1 = req("r1", A10)
    hits, new1 = admit(m, r1)
    assert ids(hits) == [1, 2]
    assert ids(new1) == [4]  # its own third block
    assert m.get_block_ids("r1")[0] == [1, 2, 4]
    assert [b.ref_cnt for b in m.block_pool.blocks[1:5]] == [2, 2, 1, 1]


def test_identical_requests_admitted_together_keep_separate_blocks():
    # 6 usable blocks: both requests take 3 each.
    m = manager(num_blocks=7)
    r0, r1 = req("r0", A10), req("r1", A10)
    # Both look up before either allocates: neither sees the other's blocks.
    hits0, n0 = m.get_computed_blocks(r0)
    hits1, n1 = m.get_computed_blocks(r1)
    assert ids(hits0) == ids(hits1) == [] and n0 == n1 == 0
    assert ids(m.allocate_slots(r0, 10)) == [1, 2, 3]
    assert ids(m.allocate_slots(r1, 10)) == [4, 5, 6]
    r0.num_computed_tokens = r1.num_computed_tokens = 10
    m.check_invariants()
    pool = m.block_pool
    h0, h1 = r0.block_hashes
    assert r1.block_hashes == [h0, h1]
    # Not merged: both copies carry the same hashes and the map holds both.
    assert [pool.blocks[i].block_hash for i in (1, 2, 4, 5)] == [h0, h1, h0, h1]
    assert pool.cached_block_hash_to_block.num_blocks(h0) == 2
    assert pool.cached_block_hash_to_block.num_blocks(h1) == 2
    # A lookup returns the first request's.
    assert pool.get_cached_block(h0).block_id == 1 and pool.get_cached_block(h1).block_id == 2

    m.free(r0)
    # head -> 3 -> 2* -> 1* -> tail
    assert queue(m) == "3 2* 1*"
    # r2 (nothing in common) takes all three, evicting r0's copies.
    r2 = req("r2", [50, 51, 52, 53, 54, 55, 56, 57, 58])
    assert ids(admit(m, r2)[1]) == [3, 2, 1]
    # head -> tail
    assert pool.num_evictions == 2
    # r1's copies are still findable, and now the only ones.
    assert pool.get_cached_block(h0).block_id == 4 and pool.get_cached_block(h1).block_id == 5
    assert pool.cached_block_hash_to_block.num_blocks(h0) == 1
    m.free(r2)
    r3 = req("r3", A10)
    hits, _ = admit(m, r3)
    assert ids(hits) == [4, 5]


def test_cache_salt_separates_tenants():
    m = manager(num_blocks=32)
    # The first block differs between salts, and the chain carries it forward.
    a = req("a", A10, salt="tenant-a")
    admit(m, a)
    b = req("b", A10, salt="tenant-b")
    hits, _ = admit(m, b)
    assert hits == []
    assert set(a.block_hashes).isdisjoint(b.block_hashes)
    # The same salt shares.
    a2 = req("a2", A10, salt="tenant-a")
    hits, _ = admit(m, a2)
    assert ids(hits) == m.get_block_ids("a")[0][:2]
    # No salt shares with no salt (and with an empty salt), never with a salted one.
    n1 = req("n1", A10)
    hits, _ = admit(m, n1)
    assert hits == []
    n2 = req("n2", A10)
    hits, _ = admit(m, n2)
    assert ids(hits) == m.get_block_ids("n1")[0][:2]
    e = req("e", A10, salt="")
    hits, _ = admit(m, e)
    assert ids(hits) == m.get_block_ids("n1")[0][:2]


def test_request_larger_than_the_pool_gets_none_and_changes_nothing():
    m = manager(num_blocks=6)  # 5 usable
    r0 = req("r0", A10)
    admit(m, r0)
    m.free(r0)
    r1 = req("r1", [20, 21, 22, 23])
    admit(m, r1)
    # head -> 4 -> 5 -> 2* -> 1* -> tail     (block 3 went to the front, then to r1)
    assert queue(m) == "4 5 2* 1*"
    before = snapshot(m)
    big = req("big", A8 + list(range(30, 50)))  # 28 tokens: 7 blocks, 2 of them hits
    hits, n = m.get_computed_blocks(big)
    assert ids(hits) == [2, 1] or ids(hits) == [1, 2]
    assert m.allocate_slots(big, big.num_tokens - n, n, hits) is None
    assert snapshot(m) == before
    assert "big" not in m.req_to_blocks
    m.check_invariants()


def test_hits_on_free_blocks_are_not_free_room():
    m = manager(num_blocks=5)  # 4 usable
    r0 = req("r0", A10)
    assert ids(admit(m, r0)[1]) == [1, 2, 3]
    m.free(r0)
    # head -> 3 -> 4 -> 2* -> 1* -> tail
    assert queue(m) == "3 4 2* 1*"
    # 20 tokens: 5 blocks, 2 of them hits on free blocks 1 and 2. 3 new blocks are
    # needed and 4 blocks are free, but 2 of the 4 are the hits themselves.
    r1 = req("r1", A8 + list(range(30, 42)))
    hits, n = m.get_computed_blocks(r1)
    assert ids(hits) == [1, 2] and n == 8
    before = snapshot(m)
    assert m.allocate_slots(r1, r1.num_tokens - n, n, hits) is None
    assert snapshot(m) == before
    # One block shorter fits exactly: 2 hits + 2 new.
    r2 = req("r2", A8 + list(range(30, 38)))
    hits, new = admit(m, r2)
    assert ids(hits) == [1, 2] and ids(new) == [3, 4]
    assert m.block_pool.get_num_free_blocks() == 0


def test_allocate_slots_caches_only_final_tokens():
    m = manager()
    pool = m.block_pool
    # Chunked prefill of a 12-token prompt: 5 tokens, then 7.
    r = req("r", list(range(1, 13)))
    assert len(m.allocate_slots(r, 5)) == 2
    assert m.coordinator.num_cached_block["r"] == 1
    assert [b.block_hash for b in m.req_to_blocks["r"]] == [r.block_hashes[0], None]
    r.num_computed_tokens = 5
    assert len(m.allocate_slots(r, 7)) == 1
    assert m.coordinator.num_cached_block["r"] == 3
    assert [b.block_hash for b in m.req_to_blocks["r"]] == r.block_hashes
    m.check_invariants()
    # Slots for more tokens than the request has (drafts that may be rejected):
    # room for 10, but only its 6 real tokens count, so 1 full block is cached.
    s = req("s", [7, 7, 7, 7, 7, 7])
    assert len(m.allocate_slots(s, 10)) == 3
    assert m.coordinator.num_cached_block["s"] == 1
    assert [b.block_hash is not None for b in m.req_to_blocks["s"]] == [True, False, False]
    # Lookahead slots are never cached either.
    t = req("t", [8] * 8)
    assert len(m.allocate_slots(t, 8, num_lookahead_tokens=5)) == 4
    assert m.coordinator.num_cached_block["t"] == 2
    assert [b.block_hash is not None for b in m.req_to_blocks["t"]] == [True, True, False, False]
    assert len(pool.cached_block_hash_to_block) == 3 + 1 + 2
    m.check_invariants()


def test_max_model_len_caps_slots():
    m = manager(max_model_len=8)
    r = req("r", [1, 2, 3, 4, 5, 6])
    # 6 tokens + 10 lookahead would be 4 blocks; the model holds 8 tokens: 2 blocks.
    assert len(m.allocate_slots(r, 6, num_lookahead_tokens=10)) == 2
    r.num_computed_tokens = 6
    r.append_output_token_id(7)
    r.append_output_token_id(8)
    assert ids(m.allocate_slots(r, 2)) == []
    assert len(m.req_to_blocks["r"]) == 2
    m.check_invariants()


def test_prefix_cache_stats_count_tokens():
    m = manager()
    admit(m, req("r0", A10))
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    admit(m, req("r1", A10))
    assert (s.requests, s.queries, s.hits) == (2, 20, 8)
    admit(m, req("r2", A8))  # 1 hit: the last token is always computed
    assert (s.requests, s.queries, s.hits) == (3, 28, 12)
    assert s.hit_rate == 12 / 28


def test_without_log_stats_there_are_no_prefix_cache_stats_and_hits_still_happen():
    # vLLM's KVCacheManager(log_stats=False): prefix_cache_stats is None; the cache works the same.
    m = manager(log_stats=False)
    assert m.prefix_cache_stats is None
    admit(m, req("r0", A10))
    hits, _ = admit(m, req("r1", A10))
    assert len(hits) * BS == 8 and m.prefix_cache_stats is None


def test_prefix_cache_stats_count_resumed_requests_apart():
    m = manager()
    admit(m, req("r0", A10))
    r1 = req("r1", A10)
    r1.num_preemptions = 1  # resumed after a preemption
    admit(m, r1)
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 10, 8)
    assert s.hit_rate == 0.0 and s.preempted_hit_rate == 8 / 10


def test_caching_disabled_no_hits_no_hashes_lifo_reuse():
    m = manager(num_blocks=8, enable_caching=False)
    pool = m.block_pool
    r0 = req("r0", A10)
    assert ids(admit(m, r0)[1]) == [1, 2, 3]
    assert all(b.block_hash is None for b in pool.blocks)
    m.free(r0)
    # Freed last-first, every block to the front: the last block is reused first.
    # head -> 3 -> 2 -> 1 -> 4 -> 5 -> 6 -> 7 -> tail
    assert queue(m) == "3 2 1 4 5 6 7"
    r1 = req("r1", A10)
    hits, new = admit(m, r1)
    assert hits == [] and ids(new) == [3, 2, 1]
    assert len(pool.cached_block_hash_to_block) == 0
    assert m.prefix_cache_stats.queries == 0
    assert all(b.block_hash is None for b in pool.blocks)


def test_free_order_is_last_block_first():
    m = manager(num_blocks=8)
    r0 = req("r0", list(range(1, 15)))  # 14 tokens: 3 full blocks + 2 tokens
    assert ids(admit(m, r0)[1]) == [1, 2, 3, 4]
    # head -> 5 -> 6 -> 7 -> tail
    m.free(r0)
    # The partial block (no hash) goes to the front; the hashed ones to the back,
    # deepest first, so the request's first block is evicted last.
    # head -> 4 -> 5 -> 6 -> 7 -> 3* -> 2* -> 1* -> tail
    assert queue(m) == "4 5 6 7 3* 2* 1*"
    r1 = req("r1", [90] * 20)  # 5 blocks: 4 unhashed, then evicts 3
    admit(m, r1)
    assert m.block_pool.num_evictions == 1
    assert m.block_pool.get_cached_block(r0.block_hashes[2]) is None
    assert m.block_pool.get_cached_block(r0.block_hashes[0]).block_id == 1
    # head -> 2* -> 1* -> tail
    assert queue(m) == "2* 1*"


def test_reset_prefix_cache_refuses_while_held_and_clears_after():
    m = manager()
    pool = m.block_pool
    r0 = req("r0", A10)
    admit(m, r0)
    before = snapshot(m)
    assert m.reset_prefix_cache() is False
    assert snapshot(m) == before
    m.free(r0)
    assert pool.num_free_cached_blocks == 2
    assert m.reset_prefix_cache() is True
    assert len(pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_cached_blocks == 0
    m.check_invariants()
    hits, _ = admit(m, req("r1", A10))
    assert hits == []


def test_kv_events():
    rec = KVEventRecorder()
    m = manager(num_blocks=7, event_sink=rec)
    r0, r1 = req("r0", A10), req("r1", A10)
    h0, h1 = r0.block_hashes
    m.get_computed_blocks(r0)
    m.get_computed_blocks(r1)
    m.allocate_slots(r0, 10)
    assert rec.take_events() == [BlockStored([h0, h1], None, A8, BS)]
    # r1's blocks carry the same hashes: nothing new for a router, no event.
    m.allocate_slots(r1, 10)
    assert rec.take_events() == []
    r0.num_computed_tokens = r1.num_computed_tokens = 10
    # r0 grows to fill its third block: stored, chained to h1.
    r0.append_output_token_id(11)
    r0.append_output_token_id(12)
    assert ids(m.allocate_slots(r0, 2)) == []
    h2 = r0.block_hashes[2]
    assert rec.take_events() == [BlockStored([h2], h1, [9, 10, 11, 12], BS)]
    m.check_invariants()

    # Free r0: head -> 3* -> 2* -> 1* -> tail. Evicting its copies of h0, h1 (r1
    # still holds blocks with them) sends nothing; evicting h2 (its only block) does.
    m.free(r0)
    assert queue(m) == "3* 2* 1*"
    r2 = req("r2", [40] * 9)
    admit(m, r2)
    assert rec.take_events() == [BlockRemoved([h2])] + [BlockStored(r2.block_hashes, None, [40] * 8, BS)]
    # Evicting the last block holding h0/h1 (r1's) sends BlockRemoved for each.
    m.free(r2)
    m.free(r1)
    # r2's table is [3, 2, 1]: 3 and 2 carry its hashes, 1 is its partial block.
    # head -> 6 -> 1 -> 2* -> 3* -> 5* -> 4* -> tail
    assert queue(m) == "6 1 2* 3* 5* 4*"
    r3 = req("r3", [41] * 21)  # 6 blocks: everything
    admit(m, r3)
    removed = [e for e in rec.events if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved([h]) for h in (r2.block_hashes[1], r2.block_hashes[0], h1, h0)]
    rec.take_events()
    m.free(r3)
    assert m.reset_prefix_cache() is True
    assert rec.take_events() == [AllBlocksCleared()]


def test_kv_event_tokens_line_up_with_stored_hashes():
    """When some of the blocks being cached duplicate hashes already in the map,
    each BlockStored still carries exactly the tokens of its hashes and the parent
    of its first hash (a router rebuilds the chain from them)."""
    rec = KVEventRecorder()
    m = manager(num_blocks=16, event_sink=rec)
    a = req("a", A8 + [0])
    b = req("b", A8 + [9, 9, 9, 9, 9, 9, 9, 9, 0])  # same two first blocks, then two more
    m.get_computed_blocks(a)
    m.get_computed_blocks(b)
    m.allocate_slots(a, a.num_tokens)
    assert rec.take_events() == [BlockStored(a.block_hashes, None, A8, BS)]
    m.allocate_slots(b, b.num_tokens)
    # b's first two hashes are duplicates; only the last two are new.
    assert rec.take_events() == [BlockStored(b.block_hashes[2:], b.block_hashes[1], [9] * 8, BS)]
    m.check_invariants()
    # New, duplicate, new: one event per run of new hashes, each with its own parent.
    m.free(a)
    m.free(b)
    assert m.reset_prefix_cache() is True
    rec.take_events()
    c = req("c", [5] * 8 + [0])
    m.allocate_slots(c, c.num_tokens)
    hc = c.block_hashes
    rec.take_events()
    d = req("d", [6] * 4 + [5] * 8 + [0])  # differs from c in its first block only
    e = req("e", [6] * 4 + [5] * 4 + [7] * 4 + [0])
    m.allocate_slots(d, d.num_tokens)
    rec.take_events()
    # e: block 0 duplicates d's, block 1 duplicates d's, block 2 is new.
    m.allocate_slots(e, e.num_tokens)
    assert rec.take_events() == [BlockStored([e.block_hashes[2]], e.block_hashes[1], [7] * 4, BS)]
    # f shares c's chain only through a block-level duplicate in the middle: build
    # it by hand on the pool so that hash 0 is new, hash 1 is a duplicate, hash 2 new.
    pool = m.block_pool
    blocks = pool.get_new_blocks(3)
    tokens = list(range(100, 112))
    pool.cache_full_blocks(blocks, [b"x0", hc[1], b"x2"], 0, 3, tokens, BS)
    assert rec.take_events() == [
        BlockStored([b"x0"], None, tokens[0:4], BS),
        BlockStored([b"x2"], hc[1], tokens[8:12], BS),
    ]

