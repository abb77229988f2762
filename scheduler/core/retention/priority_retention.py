"""Priority-aware retention (``--scheduling-policy priority``): the blocks a
lower-priority request freed are evicted before those a higher-priority one freed.

`PriorityBlockPolicy` keeps one policy per priority value (vLLM's convention: a
lower value is served first, so it is kept longer) and evicts from the class with
the highest value that has a block; within a class the chosen eviction policy
decides. `PriorityKVCacheManager` tells it the freeing request's priority. With
every request at one priority this is the chosen policy alone.

Per call: O(1) plus the number of priority classes seen so far, which the hooks
visit (each class keeps its own per-block state) and a new class's insertion into
the sorted list of classes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.retention.block_policy import BlockPolicy


class PriorityBlockPolicy(BlockPolicy):
    __slots__ = ("_make", "_num_blocks", "_classes", "_keys", "_class_of", "_len", "release_priority")

    def __init__(self, num_blocks: int, make_policy: Callable[[int], BlockPolicy]) -> None:
        self._make = make_policy
        self._num_blocks = num_blocks
        # priority -> its policy; _keys: the priorities, ascending.
        self._classes: dict[int, BlockPolicy] = {}
        self._keys: list[int] = []
        # block id -> the priority it was freed at (valid while it is free).
        self._class_of = [0] * num_blocks
        self._len = 0
        # The priority of the request whose blocks are being freed.
        self.release_priority = 0

    def add_class(self, priority: int) -> None:
        """Make sure ``priority``'s class exists before any block it will hold is
        cached or hit: a class made later would miss their per-block state."""
        if priority not in self._classes:
            self._class(priority)

    def _class(self, priority: int) -> BlockPolicy:
        policy = self._classes.get(priority)
        if policy is None:
            policy = self._classes[priority] = self._make(self._num_blocks)
            bisect.insort(self._keys, priority)
        return policy

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        for policy in self._classes.values():
            policy.on_cached(block, parent)

    def on_hit(self, block: KVCacheBlock) -> None:
        for policy in self._classes.values():
            policy.on_hit(block)

    def on_uncached(self, block: KVCacheBlock) -> None:
        for policy in self._classes.values():
            policy.on_uncached(block)

    def insert(self, block: KVCacheBlock) -> None:
        priority = self.release_priority
        self._class(priority).insert(block)
        self._class_of[block.block_id] = priority
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        self._classes[self._class_of[block.block_id]].remove(block)
        self._len -= 1

    def evict(self) -> KVCacheBlock:
        for priority in reversed(self._keys):
            policy = self._classes[priority]
            if len(policy):
                block = policy.evict()
                self._len -= 1
                for other in self._classes.values():
                    if other is not policy:
                        other.on_uncached(block)
                return block
        raise ValueError("no free cached block to evict")

    def clear(self) -> None:
        for policy in self._classes.values():
            policy.clear()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for priority in self._keys:
            yield from self._classes[priority]


class PriorityKVCacheManager(KVCacheManager):
    """Tells the pool's `PriorityBlockPolicy` the priority of each request it admits
    (its class is made) and frees (its blocks join that class); with sliding-window
    groups also those its window leaves behind, freed while it allocates."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.allocate_next_slot = self._allocate_next_slot

    def allocate_slots(self, request: KVCacheRequest, *args, **kwargs):
        priority = getattr(request, "priority", 0)
        self.block_pool.policy.add_class(priority)
        self.block_pool.policy.release_priority = priority
        return super().allocate_slots(request, *args, **kwargs)

    def _allocate_next_slot(self, request: KVCacheRequest):
        self.block_pool.policy.release_priority = getattr(request, "priority", 0)
        return self.coordinator.allocate_next_slot(request)

    def free(self, request: KVCacheRequest, num_computed_tokens: int | None = None) -> None:
        self.block_pool.policy.release_priority = getattr(request, "priority", 0)
        super().free(request, num_computed_tokens)
