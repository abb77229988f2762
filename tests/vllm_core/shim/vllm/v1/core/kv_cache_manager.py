"""vLLM's KVCacheManager and KVCacheBlocks over kvpool's KVCacheManager.

vLLM builds its manager from a KVCacheConfig; kvpool's takes plain values: the pool's
size, the block size, and one window per group (``group_windows``). So the config is
read here, and kvpool's manager built over the shim's BlockPool (vLLM's group-aware
lookups). What kvpool's manager lacks is refused with NotMapped: EAGLE, groups of
different block sizes, hashes finer than a block, context parallelism, Mamba and MLA
specs (unmapped names), external (connector) tokens, encoder tokens, and positive
prefix-cache retention intervals.

kvpool keys a one-group pool by the bare hash (no group id): `get_block_hash` and
`get_group_id` (kv_cache_utils.py) read such a key as group 0's.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from protocol.kv_cache_spec import is_hybrid
from scheduler.core import kv_cache_blocks
from scheduler.core.kv_cache_manager import KVCacheManager as KvpoolKVCacheManager
from scheduler.core.kv_events import KVEventRecorder
from vllm.distributed.kv_events import vllm_events
from vllm.unmapped import module_getattr, refuse
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from vllm.v1.request import Request

__all__ = ["KVCacheBlocks", "KVCacheManager", "Request"]
__getattr__ = module_getattr(__name__)


class KVCacheBlocks(kv_cache_blocks.KVCacheBlocks):
    """kvpool's KVCacheBlocks, with vLLM's choice of groups in get_block_ids."""

    def get_block_ids(self, group_ids=None):
        blocks = self.blocks if group_ids is None else [self.blocks[g] for g in group_ids]
        return tuple([b.block_id for b in group] for group in blocks)


def group_windows(config: KVCacheConfig) -> list[int]:
    """One window per group (0: full attention), refusing what kvpool's manager lacks."""
    windows = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        if group.is_eagle_group:
            refuse("an EAGLE group")
        if type(spec) not in (FullAttentionSpec, SlidingWindowSpec):
            refuse(f"a {type(spec).__name__} group")
        windows.append(spec.sliding_window)
    block_sizes = {g.kv_cache_spec.block_size for g in config.kv_cache_groups}
    if len(block_sizes) != 1:
        refuse("groups of different block sizes (kvpool: one block size)")
    return windows


class KVCacheManager:
    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int, scheduler_block_size: int | None = None,
                 hash_block_size: int | None = None, enable_caching: bool = True, use_eagle: bool = False,
                 log_stats: bool = False, enable_kv_cache_events: bool = False, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, max_in_flight_tokens: int | None = None, **kwargs):
        if kwargs:
            refuse(f"KVCacheManager({', '.join(kwargs)})")
        if use_eagle:
            refuse("EAGLE (use_eagle)")
        if dcp_world_size != 1 or pcp_world_size != 1:
            refuse("decode/prefill context parallelism")
        retention = os.environ.get("VLLM_PREFIX_CACHE_RETENTION_INTERVAL")
        if retention not in (None, "0"):
            refuse(f"a prefix-cache retention interval of {retention} (kvpool keeps vLLM serve's 0)")
        windows = group_windows(kv_cache_config)
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        if hash_block_size not in (None, block_size) or scheduler_block_size not in (None, block_size):
            refuse("hash or scheduler block sizes other than the group's")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.log_stats = log_stats
        self.events = KVEventRecorder() if enable_kv_cache_events else None
        self.manager = KvpoolKVCacheManager(kv_cache_config.num_blocks, block_size, max_model_len, enable_caching, self.events,
                                            BlockPool.factory(block_size), group_windows=windows,
                                            max_num_batched_tokens=max_in_flight_tokens, log_stats=log_stats)
        self.block_pool.group_keyed = is_hybrid(windows)

    @property
    def block_pool(self) -> BlockPool:
        return self.manager.block_pool

    @property
    def prefix_cache_stats(self):
        return self.manager.prefix_cache_stats

    @property
    def num_groups(self) -> int:
        return self.manager.num_groups

    @property
    def coordinator(self):
        """vLLM's coordinator, as far as tests read it: each group's tables."""
        tables = self.manager.coordinator.req_to_blocks_per_group()
        return SimpleNamespace(single_type_managers=tuple(SimpleNamespace(req_to_blocks=t) for t in tables))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's (hits, hit tokens, shared-prefix junction)."""
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        boundary = getattr(self.manager.coordinator, "shared_prefix_boundary", {}).get(request.request_id, 0)
        return KVCacheBlocks(hits.blocks), num_hit_tokens, boundary

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False) -> KVCacheBlocks | None:
        if num_external_computed_tokens:
            refuse("external (connector) computed tokens in allocate_slots")
        if num_encoder_tokens:
            refuse("encoder tokens")
        new = self.manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                          num_lookahead_tokens, full_sequence_must_fit, delay_cache=delay_cache_blocks)
        return None if new is None else KVCacheBlocks(new.blocks)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        tables = self.manager.coordinator.req_to_blocks_per_group()
        return KVCacheBlocks(tuple(list(t.get(request_id, ())) for t in tables))

    def get_block_ids(self, request_id: str):
        return self.manager.get_block_ids(request_id)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def take_events(self) -> list:
        return [] if self.events is None else vllm_events(self.events.take_events())

    def new_step_starts(self) -> None:
        """kvpool's manager keeps no state per step: nothing to reset."""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_loaded(request, num_computed_tokens)

    @property
    def usage(self) -> float:
        return self.manager.usage
