"""The spec's "Try it" questions on where freed blocks go, through the real
KVCacheManager with the simulator's what-if pools (``pool_factory``)."""

from __future__ import annotations

import pytest
from kvtest.walkthrough import BLOCK_SIZE, admit_tokens, queue_str, run_walkthrough

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from simulator.free_policies import pool_class


@pytest.mark.parametrize("policy", ["vllm", "tail"])
def test_try_it_walkthrough_request_2_evicts_nothing_in_either_design(policy):
    # With the spec's own request 2 (3 hits, 5 new) both designs have enough
    # unhashed blocks in front of the cached ones: nothing is evicted yet.
    text, manager = run_walkthrough(pool_class(policy))
    r2_part = text.split("request 2 arrives")[1].split("request 3 arrives")[0]
    assert "evict" not in r2_part
    assert manager.block_pool.num_evictions == 1  # block 5, for request 3


def test_try_it_tail_design_evicts_a_cached_block_while_an_unhashed_one_is_free():
    # Request 2 sharing nothing and needing 6 blocks, after r0 and r1 have finished.
    # vLLM:  head -> 6 -> 4 -> 7 -> 8 -> 9 -> 10 -> 3* -> 5* -> 2* -> 1* -> tail
    # tail:  head -> 7 -> 8 -> 9 -> 10 -> 4 -> 3* -> 6 -> 5* -> 2* -> 1* -> tail
    r2 = [ord("q")] * 24
    results = {}
    for policy in ("vllm", "tail"):
        manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64, pool_factory=pool_class(policy))
        r0 = admit_tokens(manager, "r0", [ord(c) for c in "ABCDEFGHIJKLMNO"])
        r1 = admit_tokens(manager, "r1", [ord(c) for c in "ABCDEFGHIJxxxx"])
        manager.free(r0)
        manager.free(r1)
        results[policy] = queue_str(manager)
        before = {b.block_id: b.block_hash for b in manager.block_pool.blocks if b.block_hash is not None}
        admit_tokens(manager, "r2", r2)
        manager.check_invariants()
        blocks = manager.block_pool.blocks
        results[policy + "_lost"] = sorted(i for i, h in before.items() if blocks[i].block_hash != h)
    assert results["vllm"] == "6 4 7 8 9 10 3* 5* 2* 1*"
    assert results["tail"] == "7 8 9 10 4 3* 6 5* 2* 1*"
    # vLLM's design uses the six unhashed blocks; the old design throws away block 3
    # (r0's third block: still useful cache) and leaves unhashed block 6 free.
    assert results["vllm_lost"] == []
    assert results["tail_lost"] == [3]


@pytest.mark.parametrize(("policy", "first_evicted"), [("vllm", "own"), ("forward", "system")])
def test_try_it_forward_free_order_evicts_the_system_prompt_first(policy, first_evicted):
    # One request: 2 blocks of system prompt + 2 blocks of its own, all full.
    manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64, pool_factory=pool_class(policy))
    system, own = list(range(100, 108)), list(range(200, 208))
    req = admit_tokens(manager, "r", system + own + [1])
    system_ids = manager.get_block_ids("r")[0][:2]
    own_ids = manager.get_block_ids("r")[0][2:4]
    manager.free(req)
    hashed = [b.block_id for b in manager.block_pool.free_block_queue if b.block_hash is not None]
    # The first hashed block in the queue is the first to be evicted.
    if first_evicted == "own":
        assert hashed == [own_ids[1], own_ids[0], system_ids[1], system_ids[0]]
    else:
        assert hashed == system_ids + own_ids
    # And the next request that needs every free block evicts exactly that one first.
    pool = manager.block_pool
    n_unhashed = pool.get_num_free_blocks() - len(hashed)
    pool.get_new_blocks(n_unhashed + 1)
    assert pool.get_cached_block(Request("x", system + own, 1, block_hasher=BlockHasher(BLOCK_SIZE)).block_hashes[0]) is (
        None if first_evicted == "system" else pool.blocks[system_ids[0]]
    )
    pool.check_invariants()


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown free policy 'lifo'"):
        pool_class("lifo")
