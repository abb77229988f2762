"""ARCBlockPolicy (``--kv-eviction-policy arc``): Adaptive Replacement Cache
(Megiddo & Modha, FAST 2003) over the free cached blocks.

T1 holds the free cached blocks not hit since they got their hash (seen once),
T2 those hit at least once (seen again), each least recently freed first. B1 and
B2 remember the hashes last evicted from each. A block freed for the first time
since it got its hash whose hash is in a ghost list was evicted and computed
again: a ghost hit. It joins T2, and the target size p of T1 moves toward the
list that would have kept it (up for B1, down for B2), by ARC's step. Eviction
takes T1's oldest while T1 is over p (or T2 is empty), else T2's oldest.

Unlike textbook ARC, T1 and T2 hold only the evictable (free) blocks: held blocks
cannot be evicted, so they take no part. Every call is O(1); ghost lists are
capped at the pool's size each.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.retention.block_policy import BlockPolicy


class ARCBlockPolicy(BlockPolicy):
    __slots__ = ("_hit", "_in_t2", "_t1", "_t2", "_b1", "_b2", "_capacity", "p")

    def __init__(self, num_blocks: int) -> None:
        self._hit = [False] * num_blocks
        self._in_t2 = [False] * num_blocks
        self._t1: OrderedDict[KVCacheBlock, None] = OrderedDict()
        self._t2: OrderedDict[KVCacheBlock, None] = OrderedDict()
        self._b1: OrderedDict[BlockHash, None] = OrderedDict()
        self._b2: OrderedDict[BlockHash, None] = OrderedDict()
        self._capacity = max(1, num_blocks - 1)
        # Target size of T1, 0..capacity.
        self.p = 0.0

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        i = block.block_id
        self._hit[i] = False
        self._in_t2[i] = False
        # A ghost hit: the hash was evicted, and is computed again.
        h = block.block_hash
        if h in self._b1:
            del self._b1[h]
            self.p = min(self._capacity, self.p + max(1.0, len(self._b2) / max(1, len(self._b1))))
            self._in_t2[i] = True
        elif h in self._b2:
            del self._b2[h]
            self.p = max(0.0, self.p - max(1.0, len(self._b1) / max(1, len(self._b2))))
            self._in_t2[i] = True

    def on_hit(self, block: KVCacheBlock) -> None:
        self._hit[block.block_id] = True

    def insert(self, block: KVCacheBlock) -> None:
        i = block.block_id
        if self._hit[i]:
            self._in_t2[i] = True
        (self._t2 if self._in_t2[i] else self._t1)[block] = None

    def remove(self, block: KVCacheBlock) -> None:
        if self._in_t2[block.block_id]:
            del self._t2[block]
        else:
            del self._t1[block]

    def evict(self) -> KVCacheBlock:
        t1, t2 = self._t1, self._t2
        if t1 and (len(t1) > self.p or not t2):
            block = t1.popitem(last=False)[0]
            ghost = self._b1
        else:
            block = t2.popitem(last=False)[0]
            ghost = self._b2
        ghost[block.block_hash] = None
        if len(ghost) > self._capacity:
            ghost.popitem(last=False)
        return block

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self.p = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self._t1
        yield from self._t2
