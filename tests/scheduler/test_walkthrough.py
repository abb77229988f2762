"""The spec's walkthrough (kv-cache-internals.md, "Code"), driven through the real
KVCacheManager and BlockPool (block size 4, 11 blocks, four requests), line for
line, and its "Try it" questions as tests. Tokens are letters (code points)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.hashing import BlockHasher
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request

BLOCK_SIZE = 4


def queue_str(manager: KVCacheManager) -> str:
    return " ".join(f"{b.block_id}*" if b.block_hash is not None else str(b.block_id) for b in manager.block_pool.free_block_queue)


def admit(manager: KVCacheManager, hasher: BlockHasher, name: str, tokens: str, out: list[str]) -> Request:
    req = Request(name, [ord(c) for c in tokens], max_tokens=1, block_hasher=hasher)
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    need = -(-len(tokens) // BLOCK_SIZE) - len(hits)
    out.append(f"  {name}: {len(tokens)} tokens, {len(hits)} block(s) from cache, {need} new")
    # Which blocks get_new_blocks will take, read before it takes them, to print evictions.
    pool = manager.block_pool
    hit_ids = {b.block_id for b in hits}
    front = [b for b in pool.free_block_queue if b.block_id not in hit_ids][:need]
    for b in front:
        if b.block_hash is not None:
            out.append(f"    evict: block {b.block_id} loses its hash")
    new = manager.allocate_slots(req, len(tokens) - num_hit_tokens, num_hit_tokens, hits)
    assert new is not None and len(new) == need
    out.append(f"    block table [{' '.join(map(str, manager.get_block_ids(name)))}]")
    return req


def run_walkthrough(policy: str = "vllm", r2_tokens: str = "ABCDEFGHIJKLyyyyyyyyyyyyyyyyy") -> tuple[str, KVCacheManager]:
    manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64, policy=policy)
    hasher = BlockHasher(BLOCK_SIZE)
    out: list[str] = []

    def show() -> None:
        out.append(f"    free queue (front first, * = cached): {queue_str(manager)}")
        out.append("")
        manager.check_invariants()

    out.append("start")
    show()
    out.append("request 0 arrives")
    r0 = admit(manager, hasher, "r0", "ABCDEFGHIJKLMNO", out)
    show()
    out.append("request 1 arrives; its first 10 tokens match request 0")
    r1 = admit(manager, hasher, "r1", "ABCDEFGHIJxxxx", out)
    show()
    out.append("request 0 finishes")
    manager.free(r0)
    show()
    out.append("request 1 finishes")
    manager.free(r1)
    show()
    out.append("request 2 arrives; its first 12 tokens match request 0")
    admit(manager, hasher, "r2", r2_tokens, out)
    show()
    out.append("request 3 arrives; nothing in common with the others")
    admit(manager, hasher, "r3", "zzzzzzzz", out)
    show()
    return "\n".join(out), manager


EXPECTED = Path(__file__).resolve().parents[3] / "shared" / "testdata" / "seed_walkthrough.expected.txt"


def test_walkthrough_prints_the_expected_output_line_for_line():
    expected = EXPECTED.read_text()
    got, _ = run_walkthrough()
    # The program prints each line with a newline, and a blank line after each queue.
    assert (got + "\n").splitlines() == expected.splitlines()
    assert got + "\n" == expected


def _admit(manager: KVCacheManager, name: str, tokens: list[int]) -> Request:
    req = Request(name, tokens, max_tokens=1, block_hasher=BlockHasher(BLOCK_SIZE))
    hits, n = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - n, n, hits) is not None
    return req


@pytest.mark.parametrize("policy", ["vllm", "tail"])
def test_try_it_walkthrough_request_2_evicts_nothing_in_either_design(policy):
    # With the spec's own request 2 (3 hits, 5 new) both designs have enough
    # unhashed blocks in front of the cached ones: nothing is evicted yet.
    text, manager = run_walkthrough(policy)
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
        manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64, policy=policy)
        r0 = _admit(manager, "r0", [ord(c) for c in "ABCDEFGHIJKLMNO"])
        r1 = _admit(manager, "r1", [ord(c) for c in "ABCDEFGHIJxxxx"])
        manager.free(r0)
        manager.free(r1)
        results[policy] = queue_str(manager)
        before = {b.block_id: b.block_hash for b in manager.block_pool.blocks if b.block_hash is not None}
        _admit(manager, "r2", r2)
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
    manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64, policy=policy)
    system, own = list(range(100, 108)), list(range(200, 208))
    req = _admit(manager, "r", system + own + [1])
    system_ids = manager.get_block_ids("r")[:2]
    own_ids = manager.get_block_ids("r")[2:4]
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


def test_try_it_usage_stays_below_one_when_only_hashed_blocks_are_free():
    manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64)
    pool = manager.block_pool
    # Fill the whole pool with full (hashed) blocks, then let the requests finish.
    reqs = [_admit(manager, f"r{i}", list(range(10 * i + 100, 10 * i + 108))) for i in range(5)]
    assert pool.get_usage() == 1.0
    for r in reqs:
        manager.free(r)
    usage_after = pool.get_usage()
    # Every free block holds a hash: the cache is full, yet usage reads 0.
    assert usage_after == 0.0
    assert all(b.block_hash is not None for b in pool.free_block_queue)
    assert pool.num_free_cached_blocks == 10
    # Hold 4 of them again: usage is 0.4 < 1.0 while every free block is cached data,
    # so the next allocation must evict.
    _admit(manager, "s", list(range(500, 516)))
    assert pool.get_usage() == pytest.approx(0.4)
    assert all(b.block_hash is not None for b in pool.free_block_queue)
    before = pool.num_evictions
    pool.get_new_blocks(1)
    assert pool.num_evictions == before + 1
    pool.check_invariants()
