"""The spec's walkthrough (kv-cache-internals.md, "Code") through the real
KVCacheManager and BlockPool: block size 4, 11 blocks, tokens are letters."""

from __future__ import annotations

from scheduler.core.block_pool import BlockPool
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager, PoolFactory
from scheduler.sched.request import Request

BLOCK_SIZE = 4


def queue_str(manager: KVCacheManager) -> str:
    return " ".join(f"{b.block_id}*" if b.block_hash is not None else str(b.block_id) for b in manager.block_pool.free_block_queue)


def admit(manager: KVCacheManager, hasher: BlockHasher, name: str, tokens: str, out: list[str]) -> Request:
    req = Request(name, [ord(c) for c in tokens], max_tokens=1, block_hasher=hasher)
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    need = -(-len(tokens) // BLOCK_SIZE) - len(hits)
    out.append(f"  {name}: {len(tokens)} tokens, {len(hits)} block(s) from cache, {need} new")
    pool = manager.block_pool
    hashes_before = [b.block_hash for b in pool.blocks]
    evictions_before = pool.num_evictions
    new = manager.allocate_slots(req, len(tokens) - num_hit_tokens, num_hit_tokens, hits)
    assert new is not None and len(new) == need
    # The evictions are the pool's own: the new blocks (in the order the pool took
    # them) that held a hash before this allocation, checked against its counter.
    evicted = [b.block_id for b in new.blocks[0] if hashes_before[b.block_id] is not None]
    assert pool.num_evictions - evictions_before == len(evicted)
    for block_id in evicted:
        out.append(f"    evict: block {block_id} loses its hash")
    out.append(f"    block table [{' '.join(map(str, manager.get_block_ids(name)[0]))}]")
    return req


def run_walkthrough(pool_factory: PoolFactory = BlockPool, r2_tokens: str = "ABCDEFGHIJKLyyyyyyyyyyyyyyyyy") -> tuple[str, KVCacheManager]:
    manager = KVCacheManager(11, BLOCK_SIZE, max_model_len=64, pool_factory=pool_factory)
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


def admit_tokens(manager: KVCacheManager, name: str, tokens: list[int]) -> Request:
    req = Request(name, tokens, max_tokens=1, block_hasher=BlockHasher(BLOCK_SIZE))
    hits, n = manager.get_computed_blocks(req)
    assert manager.allocate_slots(req, req.num_tokens - n, n, hits) is not None
    return req
