"""BlockHashToBlockMap: the prefix cache's index, hash -> one or several blocks.

NOTE: blocks are not de-duplicated. When two requests fill blocks with the same
tokens at the same time, both blocks get the same hash and both stay: block ids,
once in a table, never change, so block tables stay append-only. A lookup returns
the first block of a hash; removing one keeps the others.

The common case is one block per hash, stored bare; a dict is made only for
duplicates (the same trick as vLLM, to avoid a container per entry).
"""

from __future__ import annotations

from collections.abc import Iterator

from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock


class BlockHashToBlockMap:
    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHash) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        if type(blocks) is KVCacheBlock:
            return blocks
        return next(iter(blocks.values()))

    def insert(self, key: BlockHash, block: KVCacheBlock) -> bool:
        """Register ``block`` under ``key``; True when ``key`` was new (no block held it)."""
        # NOTE: one dict operation in the common case (a new hash), not a get and a set.
        blocks = self._cache.setdefault(key, block)
        if blocks is block:
            return True
        if type(blocks) is KVCacheBlock:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}
        else:
            blocks[block.block_id] = block
        return False

    def pop(self, key: BlockHash, block_id: int) -> tuple[KVCacheBlock | None, bool]:
        """Remove the block ``block_id`` from ``key``. Returns (the block or None,
        whether ``key`` is now gone: no block holds that hash any more)."""
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None, False
        if type(blocks) is KVCacheBlock:
            if blocks.block_id == block_id:
                return blocks, True
            self._cache[key] = blocks  # not ours: put it back
            return None, False
        block = blocks.pop(block_id, None)
        if len(blocks) == 1:
            self._cache[key] = next(iter(blocks.values()))
        else:
            self._cache[key] = blocks
        return block, False

    def num_blocks(self, key: BlockHash) -> int:
        blocks = self._cache.get(key)
        if blocks is None:
            return 0
        return 1 if type(blocks) is KVCacheBlock else len(blocks)

    def items(self) -> Iterator[tuple[BlockHash, KVCacheBlock]]:
        """Every (hash, block) pair, duplicates included."""
        for key, blocks in self._cache.items():
            if type(blocks) is KVCacheBlock:
                yield key, blocks
            else:
                for block in blocks.values():
                    yield key, block

    def keys(self):
        return self._cache.keys()

    def clear(self) -> None:
        self._cache.clear()

    def __len__(self) -> int:
        """Number of distinct hashes."""
        return len(self._cache)

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._cache
