"""BlockPolicy: the order in which the device pool evicts its free cached blocks,
for eviction policies other than LRU (``--kv-eviction-policy``).

With ``lru`` (the default) the free queue's own order is the policy and none of
this runs (`free_block_queue.py`). Any other policy is an object that orders only
the free blocks that hold a hash; free blocks without one (never filled, or their
hash dropped) stay in the free queue's list and are reused first, LIFO, exactly as
with LRU (`policy_free_queue.py`): they can never be hit, so taking them first
never costs a hit under any policy.

Every policy keeps per-block state in flat lists indexed by block id and is O(1)
per call (amortized where a policy says so). Orders are OrderedDicts: a plain
dict's ``next(iter(d))`` walks the holes that deletions at its front leave behind,
so a FIFO over one is O(n) per pop. The queue calls:

* ``insert(block)``: a block holding a hash lost its last owner (now evictable);
* ``remove(block)``: a hit took it out of the free set;
* ``evict()``: take the next victim (the queue only asks when one exists); it
  still holds its hash, which the pool then drops (lazy eviction);
* ``on_hit(block)``: every hit, held block or free (before ``remove``);
* ``on_cached(block, parent)``: the block got its hash (``parent``: the block
  before it in the request's row, None for a first block);
* ``on_uncached(block)``: a held block lost its hash without an eviction;
* ``clear()``: every hash is gone (reset).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from scheduler.core.kv_cache_block import KVCacheBlock


class BlockPolicy:
    """Base: no-op hooks; a policy overrides what it needs."""

    __slots__ = ()

    def insert(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def remove(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def evict(self) -> KVCacheBlock:
        raise NotImplementedError

    def on_hit(self, block: KVCacheBlock) -> None:
        return None

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        return None

    def on_uncached(self, block: KVCacheBlock) -> None:
        return None

    def clear(self) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The evictable blocks, in no promised order (invariant checks, tests)."""
        raise NotImplementedError


class LRUBlockPolicy(BlockPolicy):
    """Least recently freed first: the free queue's own order, as an object, for
    where an object is needed (one class of priority retention)."""

    __slots__ = ("_order",)

    def __init__(self, num_blocks: int = 0) -> None:
        self._order: OrderedDict[KVCacheBlock, None] = OrderedDict()

    def insert(self, block: KVCacheBlock) -> None:
        self._order[block] = None

    def remove(self, block: KVCacheBlock) -> None:
        del self._order[block]

    def evict(self) -> KVCacheBlock:
        order = self._order
        block = order.popitem(last=False)[0]
        return block

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._order)
