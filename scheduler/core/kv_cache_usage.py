"""KV-cache usage beyond vLLM's gauge: the peak since start, and usage in tokens.

vllm:kv_cache_usage_perc (`KVCacheManager.usage`) is the share of blocks held when
it is read. Two readings of a manager it cannot give: its highest value since start
(kvpool_peak_kv_cache_usage_perc), which a poll between steps misses since frees end
every step, so the manager keeps the fewest free blocks seen right after each
allocation; and usage in tokens (kvpool_kv_cache_token_usage_perc), which tells a
block holding one token from a full one.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_cache_request import KVCacheRequest


def get_peak_usage(kv_cache_manager: KVCacheManager) -> float:
    """The highest `usage` since start (vllm:kv_cache_usage_perc's peak)."""
    return 1.0 - kv_cache_manager.min_num_free_blocks / (kv_cache_manager.block_pool.num_gpu_blocks - 1)


def get_num_held_tokens(kv_cache_manager: KVCacheManager, requests: Iterable[KVCacheRequest]) -> int:
    """Token slots of the held blocks that hold a token (computed or scheduled),
    a shared block counted once. ``requests``: every request holding blocks.

    NOTE: a shared block is full (only full blocks are cached), so every empty
    slot is in the private tail of one request's table: held slots minus each
    request's empty tail."""
    block_size = kv_cache_manager.block_size
    pool = kv_cache_manager.block_pool
    num_used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    num_empty = 0
    # NOTE: hybrid KV-cache groups: each group's table has its own empty tail (a sliding
    # group's null entries are no block, so not in num_used).
    for get in [tables.get for tables in kv_cache_manager.coordinator.req_to_blocks_per_group()]:
        for request in requests:
            blocks = get(request.request_id)
            if blocks:
                num_empty += max(0, len(blocks) * block_size - request.num_computed_tokens)
    return num_used * block_size - num_empty


def get_token_usage(kv_cache_manager: KVCacheManager, requests: Iterable[KVCacheRequest]) -> float:
    """Held tokens over the pool's token slots (null block left out): what
    `usage` says in blocks, in tokens (a block holding one token counts 1/block_size)."""
    pool = kv_cache_manager.block_pool
    return get_num_held_tokens(kv_cache_manager, requests) / ((pool.num_gpu_blocks - 1) * kv_cache_manager.block_size)
