"""vLLM's BlockPool: kvpool's, with vLLM's constructor and its group-aware lookups.

kvpool's pool is handed keyed hashes ((hash, group) keys) by the managers; vLLM's
takes the request and the group id. Both shapes are answered here: a call in vLLM's
shape (a ``request=`` or ``kv_cache_group_ids``) is turned into kvpool's.
"""

from __future__ import annotations

from collections import defaultdict

from scheduler.core import block_hash_map
from scheduler.core import block_pool as kvpool_block_pool
from scheduler.core.hybrid.group_events import GroupKeyedEventSink
from scheduler.core.kv_events import KVEventRecorder
from scheduler.core.single_type_kv_cache_manager import KeyedHashes, group_key
from vllm.distributed.kv_events import vllm_events
from vllm.unmapped import module_getattr, refuse

__getattr__ = module_getattr(__name__)


class BlockHashToBlockMap(block_hash_map.BlockHashToBlockMap):
    """kvpool's map; vLLM's pop returns the block alone (kvpool's: also whether the key is gone)."""

    def pop(self, key, block_id):
        return super().pop(key, block_id)[0]


class BlockPool(kvpool_block_pool.BlockPool):
    # Whether group 0's keys carry the group id: not in a pool of kvpool's one-group
    # KVCacheManager, which keys by the bare hash.
    group_keyed = True

    def __init__(self, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int,
                 enable_kv_cache_events: bool = False, metrics_collector=None, **kwargs):
        if kwargs or metrics_collector is not None:
            refuse(f"BlockPool({', '.join(kwargs) or 'metrics_collector'})")
        sink = None
        if enable_kv_cache_events:
            # NOTE: this pool's keys all carry their group (vLLM's BlockHashWithGroupId):
            # events name the bare hash and the group, as a hybrid manager's; a pool
            # alone knows no windows (0 for every group).
            sink = GroupKeyedEventSink(KVEventRecorder(), ())
            sink.group_windows = defaultdict(int)
        super().__init__(num_gpu_blocks, enable_caching, sink)
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events

    @classmethod
    def factory(cls, hash_block_size: int):
        """kvpool's pool factory (num_gpu_blocks, enable_caching, event_sink) -> this pool,
        for kvpool's managers, which build their pool themselves."""

        def build(num_gpu_blocks: int, enable_caching: bool, event_sink) -> BlockPool:
            pool = cls.__new__(cls)
            kvpool_block_pool.BlockPool.__init__(pool, num_gpu_blocks, enable_caching, event_sink)
            pool.hash_block_size = hash_block_size
            pool.enable_kv_cache_events = event_sink is not None
            return pool

        return build

    def key(self, block_hash: bytes, group_id: int) -> bytes:
        return block_hash if group_id == 0 and not self.group_keyed else block_hash + group_key(group_id)

    def get_cached_block(self, block_hash, kv_cache_group_ids=None):
        if kv_cache_group_ids is None:
            return super().get_cached_block(block_hash)
        blocks = []
        for group_id in kv_cache_group_ids:
            block = super().get_cached_block(self.key(block_hash, group_id))
            if block is None:
                return None
            blocks.append(block)
        return blocks

    def cache_full_blocks(self, blocks=None, block_hashes=None, num_cached_blocks=0, num_full_blocks=0,
                          token_ids=None, block_size=0, *, request=None, kv_cache_group_id=0, block_mask=None):
        if block_mask is not None:
            # vLLM's mask (which of the blocks to cache) as kvpool's calls: one per run of cached blocks.
            start = num_cached_blocks
            for i in range(num_cached_blocks, num_full_blocks + 1):
                if i == num_full_blocks or not block_mask[i - num_cached_blocks]:
                    if i > start:
                        self.cache_full_blocks(blocks, block_hashes, start, i, token_ids, block_size, request=request,
                                               kv_cache_group_id=kv_cache_group_id)
                    start = i + 1
            return None
        if request is None:
            return super().cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks, token_ids, block_size)
        if block_size != self.hash_block_size:
            refuse("a block size other than the hash block size")
        keyed = (request.block_hashes if self.key(b"", kv_cache_group_id) == b""
                 else KeyedHashes(request.block_hashes, group_key(kv_cache_group_id)))
        return super().cache_full_blocks(blocks, keyed, num_cached_blocks, num_full_blocks, request.all_token_ids, block_size)

    def _maybe_evict_cached_block(self, block) -> None:
        """vLLM's eviction of one block's hash: kvpool's `uncache_blocks` has the same
        effect on the map and the events (kvpool evicts inline in get_new_blocks)."""
        self.uncache_blocks([block])

    @property
    def recorder(self) -> KVEventRecorder | None:
        sink = self.event_sink
        return sink.sink if isinstance(sink, GroupKeyedEventSink) else sink

    @property
    def kv_event_queue(self) -> list:
        return [] if self.recorder is None else self.recorder.events

    def take_events(self):
        return [] if self.recorder is None else vllm_events(self.recorder.take_events(), annotate=False)
