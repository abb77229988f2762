"""vLLM's KVCacheManager and KVCacheBlocks over kvpool's managers.

vLLM builds one manager from a KVCacheConfig; kvpool takes plain values: the pool's
size, the block size, and one window per group. So the config is read here: one
full-attention group is kvpool's `KVCacheManager`, anything else (a sliding-window
group, several groups) its `HybridKVCacheManager`, both over the shim's BlockPool
(vLLM's group-aware lookups). What kvpool's managers lack is refused with NotMapped:
EAGLE, groups of different block sizes, hashes finer than a block, context
parallelism, Mamba and MLA specs (unmapped names), external (connector) tokens,
encoder tokens, and positive prefix-cache retention intervals.

kvpool keys a one-group pool by the bare hash (no group id): `get_block_hash` and
`get_group_id` (kv_cache_utils.py) read such a key as group 0's.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from scheduler.core.grouped_blocks import GroupedBlocks
from scheduler.core.hybrid_kv_cache_manager import HybridKVCacheManager
from scheduler.core.kv_cache_manager import KVCacheManager as KvpoolKVCacheManager
from scheduler.core.kv_events import KVEventRecorder
from vllm.distributed.kv_events import vllm_events
from vllm.unmapped import module_getattr, refuse
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec
from vllm.v1.request import Request

__all__ = ["KVCacheBlocks", "KVCacheManager", "Request"]
__getattr__ = module_getattr(__name__)


class KVCacheBlocks(GroupedBlocks):
    """vLLM's KVCacheBlocks: kvpool's GroupedBlocks, block ids as vLLM's tuple."""

    __slots__ = ()

    @property
    def blocks(self):
        return self.groups

    def get_block_ids(self, group_ids=None):
        groups = self.groups if group_ids is None else [self.groups[g] for g in group_ids]
        return tuple([b.block_id for b in blocks] for blocks in groups)


def group_windows(config: KVCacheConfig) -> list[int]:
    """One window per group (0: full attention), refusing what kvpool's managers lack."""
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
        factory = BlockPool.factory(block_size)
        if windows == [0]:
            self.manager = KvpoolKVCacheManager(kv_cache_config.num_blocks, block_size, max_model_len, enable_caching,
                                                self.events, factory)
            self.block_pool.group_keyed = False
        else:
            self.manager = HybridKVCacheManager(kv_cache_config.num_blocks, block_size, max_model_len, windows,
                                                enable_caching, self.events, factory,
                                                max_num_batched_tokens=max_in_flight_tokens)

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
        """vLLM's coordinator, as far as tests read it: the groups' managers (their tables)."""
        if isinstance(self.manager, HybridKVCacheManager):
            return SimpleNamespace(single_type_managers=self.manager.single_type_managers)
        return SimpleNamespace(single_type_managers=(SimpleNamespace(req_to_blocks=self.manager.req_to_blocks),))

    def blocks(self, blocks) -> KVCacheBlocks:
        return KVCacheBlocks(blocks.groups if isinstance(blocks, GroupedBlocks) else (blocks,))

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """vLLM's (hits, hit tokens, shared-prefix junction)."""
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        boundary = getattr(self.manager, "shared_prefix_boundary", {}).get(request.request_id, 0)
        return self.blocks(hits), num_hit_tokens, boundary

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False) -> KVCacheBlocks | None:
        if num_external_computed_tokens:
            refuse("external (connector) computed tokens in allocate_slots")
        if num_encoder_tokens:
            refuse("encoder tokens")
        hits = None
        if new_computed_blocks is not None:
            hits = new_computed_blocks if isinstance(self.manager, HybridKVCacheManager) else list(new_computed_blocks.blocks[0])
        if delay_cache_blocks:
            if isinstance(self.manager, HybridKVCacheManager):
                refuse("delay_cache_blocks with KV-cache groups")
            new = self.manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens, hits, num_lookahead_tokens,
                                              full_sequence_must_fit, delay_cache=True)
        else:
            new = self.manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens, hits, num_lookahead_tokens,
                                              full_sequence_must_fit)
        return None if new is None else self.blocks(new)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        if isinstance(self.manager, HybridKVCacheManager):
            return KVCacheBlocks(tuple(list(m.req_to_blocks.get(request_id, ())) for m in self.manager.single_type_managers))
        return KVCacheBlocks((list(self.manager.req_to_blocks.get(request_id, ())),))

    def get_block_ids(self, request_id: str):
        return self.get_blocks(request_id).get_block_ids()

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def take_events(self) -> list:
        return [] if self.events is None else vllm_events(self.events.take_events())

    def new_step_starts(self) -> None:
        """kvpool's managers keep no state per step: nothing to reset."""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if isinstance(self.manager, HybridKVCacheManager):
            refuse("cache_blocks with KV-cache groups")
        self.manager.cache_loaded(request, num_computed_tokens)

    @property
    def usage(self) -> float:
        return self.manager.usage
