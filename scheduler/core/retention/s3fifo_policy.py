"""S3FIFOBlockPolicy (``--kv-eviction-policy s3fifo``): S3-FIFO (Yang et al.,
SOSP 2023) over the free cached blocks.

A block freed for the first time since it got its hash joins the small FIFO S,
unless its hash is in the ghost FIFO G (evicted recently, then computed again):
then it joins the main FIFO M. Eviction takes from S while S holds more than
`SMALL_FRACTION` of the evictable blocks (or M is empty): S's oldest block moves
to M if it was hit since it joined (its count reset), else it is evicted and its
hash goes to G. From M: the oldest block goes back to M's tail with its count
less one if that count is positive, else it is evicted. A block keeps its queue
across its holds: freed again, it rejoins the tail of the queue it was in.

Counts (hits, capped at `MAX_FREQUENCY`) bound the moves: each move spends a hit
or a queue change, so ``evict`` is O(1) amortized; the rest is O(1). G holds at
most as many hashes as the pool has blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.retention.block_policy import BlockPolicy

SMALL_FRACTION = 0.1
MAX_FREQUENCY = 3
# A block's queue: none yet (first free since cached), S or M.
_NEW, _SMALL, _MAIN = 0, 1, 2


class S3FIFOBlockPolicy(BlockPolicy):
    __slots__ = ("_freq", "_queue", "_small", "_main", "_ghost", "_ghost_size")

    def __init__(self, num_blocks: int) -> None:
        self._freq = [0] * num_blocks
        self._queue = [_NEW] * num_blocks
        self._small: OrderedDict[KVCacheBlock, None] = OrderedDict()
        self._main: OrderedDict[KVCacheBlock, None] = OrderedDict()
        self._ghost: OrderedDict[BlockHash, None] = OrderedDict()
        self._ghost_size = max(1, num_blocks - 1)

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        self._freq[block.block_id] = 0
        self._queue[block.block_id] = _NEW

    def on_hit(self, block: KVCacheBlock) -> None:
        i = block.block_id
        if self._freq[i] < MAX_FREQUENCY:
            self._freq[i] += 1

    def insert(self, block: KVCacheBlock) -> None:
        i = block.block_id
        queue = self._queue[i]
        if queue == _NEW:
            queue = _SMALL
            if self._ghost.pop(block.block_hash, 0) is None:
                queue = _MAIN
            self._queue[i] = queue
        (self._small if queue == _SMALL else self._main)[block] = None

    def remove(self, block: KVCacheBlock) -> None:
        if self._queue[block.block_id] == _SMALL:
            del self._small[block]
        else:
            del self._main[block]

    def evict(self) -> KVCacheBlock:
        small, main, freq = self._small, self._main, self._freq
        while True:
            if small and (len(small) > SMALL_FRACTION * (len(small) + len(main)) or not main):
                block = small.popitem(last=False)[0]
                i = block.block_id
                if freq[i] > 0:
                    freq[i] = 0
                    self._queue[i] = _MAIN
                    main[block] = None
                    continue
                ghost = self._ghost
                ghost[block.block_hash] = None
                if len(ghost) > self._ghost_size:
                    ghost.popitem(last=False)
                return block
            block = main.popitem(last=False)[0]
            i = block.block_id
            if freq[i] > 0:
                freq[i] -= 1
                main[block] = None
                continue
            return block

    def clear(self) -> None:
        self._small.clear()
        self._main.clear()
        self._ghost.clear()

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self._small
        yield from self._main
