"""LFUBlockPolicy (``--kv-eviction-policy lfu``): the free cached block hit least
often is evicted first; among equals, the least recently freed.

A block's count is its hits since it got its hash (the request that computed it
does not count), capped at `MAX_FREQUENCY`: the cap bounds the buckets, so every
call is O(1) (``evict`` scans at most MAX_FREQUENCY + 1 buckets), and it keeps a
block that was popular long ago from outliving all newer ones forever.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.retention.block_policy import BlockPolicy

MAX_FREQUENCY = 7


class LFUBlockPolicy(BlockPolicy):
    __slots__ = ("_freq", "_buckets", "_len")

    def __init__(self, num_blocks: int) -> None:
        # block id -> hits since the block got its hash (capped).
        self._freq = [0] * num_blocks
        # count -> the free cached blocks with that count, least recently freed first.
        self._buckets: list[OrderedDict[KVCacheBlock, None]] = [OrderedDict() for _ in range(MAX_FREQUENCY + 1)]
        self._len = 0

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        self._freq[block.block_id] = 0

    def on_hit(self, block: KVCacheBlock) -> None:
        i = block.block_id
        if self._freq[i] < MAX_FREQUENCY:
            self._freq[i] += 1

    def insert(self, block: KVCacheBlock) -> None:
        self._buckets[self._freq[block.block_id]][block] = None
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        # NOTE: on_hit ran first, so the block sits in the bucket of its old count.
        freq = self._freq[block.block_id]
        bucket = self._buckets[freq]
        if block not in bucket:
            bucket = self._buckets[freq - 1]
        del bucket[block]
        self._len -= 1

    def evict(self) -> KVCacheBlock:
        for bucket in self._buckets:
            if bucket:
                block = bucket.popitem(last=False)[0]
                self._len -= 1
                return block
        raise ValueError("no free cached block to evict")

    def clear(self) -> None:
        for bucket in self._buckets:
            bucket.clear()
        self._freq = [0] * len(self._freq)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for bucket in self._buckets:
            yield from bucket
