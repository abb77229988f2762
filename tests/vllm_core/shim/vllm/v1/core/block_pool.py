"""vLLM's BlockPool: kvpool's, with vLLM's constructor and its group-aware lookups.

kvpool's pool is handed keyed hashes ((hash, group) keys) by the managers; vLLM's
takes the request and the group id. Both shapes are answered here: a call in vLLM's
shape (a ``request=`` or ``kv_cache_group_ids``) is turned into kvpool's.
"""

from __future__ import annotations

from scheduler.core import block_pool as kvpool_block_pool
from scheduler.core.block_hash_map import BlockHashToBlockMap
from scheduler.core.kv_events import KVEventRecorder
from scheduler.core.single_type_kv_cache_manager import KeyedHashes, group_key
from vllm.unmapped import module_getattr, refuse

__all__ = ["BlockHashToBlockMap"]
__getattr__ = module_getattr(__name__)


class BlockPool(kvpool_block_pool.BlockPool):
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector=None, **kwargs):
        if kwargs or metrics_collector is not None:
            refuse(f"BlockPool({', '.join(kwargs) or 'metrics_collector'})")
        super().__init__(num_gpu_blocks, enable_caching, KVEventRecorder() if enable_kv_cache_events else None)
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events

    def get_cached_block(self, block_hash, kv_cache_group_ids=None):
        if kv_cache_group_ids is None:
            return super().get_cached_block(block_hash)
        blocks = []
        for group_id in kv_cache_group_ids:
            block = super().get_cached_block(block_hash + group_key(group_id))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, blocks=None, block_hashes=None, num_cached_blocks=0, num_full_blocks=0,
                          token_ids=None, block_size=0, *, request=None, kv_cache_group_id=0):
        if request is None:
            return super().cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks, token_ids, block_size)
        if block_size != self.hash_block_size:
            refuse("a block size other than the hash block size")
        keyed = KeyedHashes(request.block_hashes, group_key(kv_cache_group_id))
        return super().cache_full_blocks(blocks, keyed, num_cached_blocks, num_full_blocks, request.all_token_ids, block_size)

    def take_events(self):
        return [] if self.event_sink is None else self.event_sink.take_events()
