"""Retention in the what-if: the server's eviction policies beside the simulator's free
policies, and a prefix pinned before the replay (as POST /v1/cache/pin would).

`retention_manager` builds the manager the server would (`--kv-eviction-policy`,
priority retention under `--scheduling-policy priority`, `--max-pinned-fraction`) over
the free policy's pool; `tail` and `forward` reorder the LRU queue themselves, so they
go with ``lru`` and fcfs only. `pin_first_prefix` pins the first request's first blocks,
their KV taken as computed already (no request, nothing counted), in every KV-cache group.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.retention.eviction_policies import (
    KV_EVICTION_POLICIES,
    eviction_pool_factory,
    kv_cache_manager_class,
)
from scheduler.core.single_type_kv_cache_manager import cdiv
from simulator.free_policies import pool_class
from simulator.workload import Workload


def retention_manager(num_blocks: int, block_size: int, max_model_len: int, free_policy: str, eviction_policy: str, scheduling_policy: str,
                      max_pinned_fraction: float, group_windows: Sequence[int] = (), max_num_batched_tokens: int | None = None,
                      **kwargs) -> KVCacheManager:
    """The manager of one simulated engine; ``group_windows``: hybrid KV-cache groups'
    windows (simulator/layer_windows.py), () for one full-attention group."""
    base = pool_class(free_policy)
    factory = eviction_pool_factory(eviction_policy, scheduling_policy, base=base)
    if factory is not base and free_policy != "vllm":
        # NOTE: the what-if free policies move blocks in the free queue's list themselves.
        raise ValueError(f"free policy {free_policy!r} orders the LRU queue only: use it with eviction policy lru and fcfs scheduling")
    return kv_cache_manager_class(scheduling_policy)(num_blocks, block_size, max_model_len, pool_factory=factory,
                                                     max_pinned_fraction=max_pinned_fraction, group_windows=group_windows,
                                                     max_num_batched_tokens=max_num_batched_tokens, **kwargs)


def pin_first_prefix(kv: KVCacheManager, workload: Workload, first: int, hasher: BlockHasher, num_blocks: int) -> None:
    """Pin the first ``num_blocks`` full blocks of request ``first``'s prompt (raises
    `PinRefused` over the cap). Each group caches them as a request of that prefix leaves
    them: full attention every block, a sliding window the tail a hit at its end reads."""
    prompt, hashes = workload.prompt(first, hasher)
    workload.reset()  # NOTE: prompt() is asked in arrival order; the replay asks again.
    hashes = (hashes if hashes is not None else hasher.block_hashes(prompt))[:num_blocks]
    pool, n = kv.block_pool, len(hashes)
    keys = kv.coordinator.pin_keys(hashes)
    held = []
    for g, window in enumerate(kv.group_windows):
        first_block = 0 if window == 0 else max(0, n - cdiv(window - 1, kv.block_size))
        group_keys = [keys[i][g] for i in range(first_block, n)]
        blocks = pool.get_new_blocks(len(group_keys))
        pool.cache_full_blocks(blocks, group_keys, 0, len(group_keys))
        held.append(blocks)
    kv.pinned.pin(hashes, 0.0)
    for blocks in held:
        pool.free_blocks(blocks[::-1])


def eviction_policy_list(text: str) -> list[str]:
    """``--kv-eviction-policy``'s comma list."""
    values = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in values if v not in KV_EVICTION_POLICIES]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown eviction policy {', '.join(bad) or text!r}; choose from {', '.join(KV_EVICTION_POLICIES)}")
    return values
