"""Helpers for KVCacheManager tests: block size 4, tokens small integers."""

from __future__ import annotations

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_blocks import KVCacheBlocks
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request

BS = 4
HASHER = BlockHasher(BS)


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), max_tokens=16, cache_salt=salt, block_hasher=HASHER)


def manager(num_blocks: int = 16, max_model_len: int = 64, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, max_model_len, **kw)


def admit(m: KVCacheManager, r: Request):
    """get_computed_blocks + allocate_slots for the whole prompt, as a scheduler
    admits a request; on success the prompt counts as computed. Returns the hits and
    the new blocks of the manager's one KV-cache group (new: None if they did not fit)."""
    hits, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, r.num_tokens - n, n, hits)
    if new is not None:
        r.num_computed_tokens = r.num_tokens
    m.check_invariants()
    return one_group(hits), None if new is None else one_group(new)


def one_group(blocks: KVCacheBlocks) -> list:
    """The blocks of a one-group manager's `KVCacheBlocks`."""
    (group,) = blocks.blocks
    return list(group)


def queue(m: KVCacheManager) -> str:
    return " ".join(f"{b.block_id}*" if b.block_hash is not None else str(b.block_id) for b in m.block_pool.free_block_queue)


def ids(blocks) -> list[int]:
    """Block ids of a list of blocks, or of a one-group manager's `KVCacheBlocks`."""
    if isinstance(blocks, KVCacheBlocks):
        blocks = one_group(blocks)
    return [b.block_id for b in blocks]


def snapshot(m: KVCacheManager):
    pool = m.block_pool
    return (
        ids(pool.free_block_queue),
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted((k, b.block_id) for k, b in pool.cached_block_hash_to_block.items()),
        {k: ids(v) for k, v in m.req_to_blocks.items()},
        dict(m.coordinator.num_cached_block),
        pool.num_evictions,
        pool.num_free_cached_blocks,
    )
