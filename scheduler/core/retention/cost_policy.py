"""CostBlockPolicy (``--kv-eviction-policy cost``): evict the free cached block
whose loss costs the least recomputation.

Recomputing a block's KV means its tokens attend to every token before them, so
the cost of one block grows with its depth in its chain (its index in the
prompt). Evicting a block also makes every cached block after it in its chain
unreachable (a prefix hit stops at the first miss), so the recomputation an
eviction forces is the block's and all its cached descendants'. The policy
therefore evicts only leaves (cached blocks no other cached block continues), the
shallowest first, least recently freed among equals. A free block always has its
cached descendants free too (a request holding a block holds its ancestors), so
whenever a free cached block exists a free leaf does.

Leaves are kept in one bucket per depth; a free block with cached children waits
apart and becomes a leaf when its last child loses its hash. ``evict`` scans
buckets up from the shallowest non-empty one: O(1) amortized (the scan pointer
only moves down on an insert); every other call is O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.retention.block_policy import BlockPolicy


class CostBlockPolicy(BlockPolicy):
    __slots__ = ("_depth", "_parent", "_children", "_leaves", "_inner", "_min", "_len")

    def __init__(self, num_blocks: int) -> None:
        self._depth = [0] * num_blocks
        self._parent: list[KVCacheBlock | None] = [None] * num_blocks
        # block id -> its cached children (blocks whose parent it is and that hold a hash).
        self._children = [0] * num_blocks
        # depth -> free cached leaves at that depth, least recently freed first.
        self._leaves: list[OrderedDict[KVCacheBlock, None]] = []
        # Free cached blocks that still have cached children.
        self._inner: OrderedDict[KVCacheBlock, None] = OrderedDict()
        self._min = 0
        self._len = 0

    def on_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        i = block.block_id
        self._children[i] = 0
        self._parent[i] = parent
        if parent is None:
            self._depth[i] = 0
        else:
            self._depth[i] = self._depth[parent.block_id] + 1
            self._children[parent.block_id] += 1

    def on_uncached(self, block: KVCacheBlock) -> None:
        self._drop_child(block)

    def _drop_child(self, block: KVCacheBlock) -> None:
        parent = self._parent[block.block_id]
        if parent is None:
            return
        self._parent[block.block_id] = None
        p = parent.block_id
        self._children[p] -= 1
        if self._children[p] == 0 and parent in self._inner:
            del self._inner[parent]
            self._add_leaf(parent)

    def _add_leaf(self, block: KVCacheBlock) -> None:
        depth = self._depth[block.block_id]
        leaves = self._leaves
        while len(leaves) <= depth:
            leaves.append(OrderedDict())
        leaves[depth][block] = None
        if depth < self._min:
            self._min = depth

    def insert(self, block: KVCacheBlock) -> None:
        if self._children[block.block_id]:
            self._inner[block] = None
        else:
            self._add_leaf(block)
        self._len += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block in self._inner:
            del self._inner[block]
        else:
            del self._leaves[self._depth[block.block_id]][block]
        self._len -= 1

    def evict(self) -> KVCacheBlock:
        leaves = self._leaves
        depth = self._min
        while depth < len(leaves) and not leaves[depth]:
            depth += 1
        if depth < len(leaves):
            self._min = depth
            bucket = leaves[depth]
            block = bucket.popitem(last=False)[0]
        else:
            # NOTE: unreachable while the invariant above holds; kept so a broken
            # chain never leaves the pool without a victim.
            self._min = 0
            block = self._inner.popitem(last=False)[0]
        self._len -= 1
        self._drop_child(block)
        return block

    def clear(self) -> None:
        for bucket in self._leaves:
            bucket.clear()
        self._inner.clear()
        n = len(self._depth)
        self._parent = [None] * n
        self._children = [0] * n
        self._min = 0
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for bucket in self._leaves:
            yield from bucket
        yield from self._inner
