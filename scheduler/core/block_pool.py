"""BlockPool: every KV block as an object, a free queue, and the prefix-cache map.

All KV memory is allocated once (by the worker); here it is only block numbers.
Memory management is moving `KVCacheBlock`s between three places: the free
queue, request block tables (held by `KVCacheManager`) and the hash map.

The rules that make an allocator into a cache:

* get_new_blocks takes from the FRONT of the free queue. A block that still has a
  hash loses it at that moment (lazy eviction): nothing is evicted in advance.
* free_blocks: a block reaching ref_cnt 0 without a hash goes to the FRONT (it can
  never be hit; reusing it first keeps the device's caches warm); with a hash it
  goes to the BACK, in the order given. Callers pass a request's blocks last-first,
  so a request's deepest block is evicted before its first.
* touch (a hit) plucks a free block out of the middle of the queue.

With caching off nothing is hashed and every freed block goes to the front: a
plain LIFO allocator.

The pool keeps plain integer counters (evictions, free blocks holding a hash); the
process turns them into metrics. No logging or metrics in the hot paths.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Sequence

from scheduler.core.block_hash_map import BlockHashToBlockMap
from scheduler.core.free_block_queue import FreeKVCacheBlockQueue
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_events import KVEventSink


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True, event_sink: KVEventSink | None = None):
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be at least 2 (block 0 is the null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        # NOTE: the cyclic GC would traverse the growing list again and again while a
        # large pool is built.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.blocks: list[KVCacheBlock] = list(map(KVCacheBlock, range(num_gpu_blocks)))
            self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        finally:
            if gc_was_enabled:
                gc.enable()
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # Block 0 is the null block: out of the free queue for good, never handed out.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        # Counters, read by the process loop (never reset here).
        self.num_evictions = 0
        # Free blocks that still hold a hash: cache that usage metrics do not show.
        self.num_free_cached_blocks = 0
        self.event_sink = event_sink
        # (block id, hash) of every hash evicted from its last device block, when not
        # None: the offload tier stores them (KVCacheManager drains it after each
        # allocation; the block is handed out, and the store precedes its reuse).
        self.evicted: list[tuple[int, BlockHash]] | None = None

    # --- allocation -------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` blocks from the front of the free queue, ref_cnt 1."""
        # Read before the blocks leave the queue: with no free block holding a hash,
        # none of those taken can need an eviction.
        may_evict = self.num_free_cached_blocks
        blocks = self.free_block_queue.popleft_n(num_blocks)
        if may_evict:
            num_evicted = 0
            for block in blocks:
                block_hash = block.block_hash
                if block_hash is not None:
                    # Lazy eviction: a free block with a hash is being reused; its hash goes.
                    block.block_hash = None
                    num_evicted += 1
                    if self.cached_block_hash_to_block.pop(block_hash, block.block_id)[1]:
                        # NOTE: only when the last block holding the hash loses it (duplicates exist).
                        if self.event_sink is not None:
                            self.event_sink.block_removed(block_hash)
                        if self.evicted is not None:
                            self.evicted.append((block.block_id, block_hash))
            self.num_evictions += num_evicted
            self.num_free_cached_blocks -= num_evicted
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """A cache hit: one more owner; a free block leaves the free queue."""
        # NOTE: every block touched is a hit, so each one leaving the queue held a hash.
        self.num_free_cached_blocks -= self.free_block_queue.acquire(blocks)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """One owner fewer for each block; blocks reaching ref_cnt 0 go back to the
        queue (`FreeKVCacheBlockQueue.release`): unhashed to the front, hashed to
        the back, in the given order."""
        self.num_free_cached_blocks += self.free_block_queue.release(ordered_blocks)

    # --- the prefix cache -------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
    ) -> None:
        """Give ``blocks[i]`` the hash ``block_hashes[i]`` for num_cached <= i < num_full
        and register it. Runs at scheduling time, before the worker has computed the
        block: safe because steps execute in order (DESIGN.md rule 3).

        ``token_ids``/``block_size`` (the request's tokens) are needed only when KV
        events are published (BlockStored carries the tokens)."""
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        insert = self.cached_block_hash_to_block.insert
        # Indices of the blocks whose hash no block held before (what a router learns).
        stored: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            if block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} is already cached")
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            if insert(block_hash, block):
                stored.append(i)
        if stored and self.event_sink is not None:
            # NOTE: a BlockStored's hashes form one chain from its parent, and its
            # tokens are exactly theirs. Duplicates are left out, so one event per
            # run of consecutive new blocks, else the tokens would not line up.
            start = prev = stored[0]
            for i in stored[1:] + [-1]:
                if i == prev + 1:
                    prev = i
                    continue
                parent = block_hashes[start - 1] if start > 0 else None
                tokens = None
                if token_ids is not None:
                    tokens = list(token_ids[start * block_size : (prev + 1) * block_size])
                self.event_sink.block_stored(list(block_hashes[start : prev + 1]), parent, tokens, block_size)
                start = prev = i

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop the hashes of ``blocks`` (held ones, cached at scheduling time for
        tokens that will not be computed after all), as an eviction would."""
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is None:
                continue
            block.block_hash = None
            if self.cached_block_hash_to_block.pop(block_hash, block.block_id)[1] and self.event_sink is not None:
                self.event_sink.block_removed(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Drop every hash. Refused (False, nothing changed) while any request holds a block."""
        num_used_blocks = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used_blocks != 1:  # the null block is always in use
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_free_cached_blocks = 0
        if self.event_sink is not None:
            self.event_sink.all_blocks_cleared()
        return True

    # --- accounting -------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """1 - free/(num_gpu_blocks - 1): the vllm:kv_cache_usage_perc gauge. Free
        blocks that still hold a hash count as free, so this stays below 1.0 while
        the cache is full of reusable data."""
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def check_invariants(self) -> None:
        """Raise AssertionError on any inconsistency (tests; O(num_blocks))."""
        queue = self.free_block_queue
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        assert head.prev_free_block is None and tail.next_free_block is None
        seen: set[int] = set()
        prev = head
        block = head.next_free_block
        while block is not tail:
            assert block is not None, "free list broken before the tail"
            assert block.prev_free_block is prev, f"block {block.block_id}: prev link disagrees"
            assert block.block_id not in seen, f"block {block.block_id} twice in the free queue"
            assert not block.is_null, "the null block is in the free queue"
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            seen.add(block.block_id)
            prev, block = block, block.next_free_block
        assert tail.prev_free_block is prev, "tail's prev link disagrees"
        assert len(seen) == queue.num_free_blocks, f"queue holds {len(seen)} but counts {queue.num_free_blocks}"
        assert self.null_block is self.blocks[0] and self.null_block.is_null
        assert self.null_block.block_hash is None
        free_cached = 0
        for block in self.blocks[1:]:
            assert not block.is_null
            if block.block_id in seen:
                free_cached += block.block_hash is not None
            else:
                assert block.ref_cnt >= 1, f"block {block.block_id} is neither free nor held"
                assert block.prev_free_block is None and block.next_free_block is None
            if block.block_hash is not None:
                assert self.enable_caching
                found = self.cached_block_hash_to_block._cache.get(block.block_hash)
                held = found is block if type(found) is KVCacheBlock else (found is not None and found.get(block.block_id) is block)
                assert held, f"block {block.block_id}'s hash is not in the map"
        n_map = 0
        for key, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == key, f"map entry for block {block.block_id} disagrees with its hash"
            n_map += 1
        assert n_map == sum(b.block_hash is not None for b in self.blocks)
        assert free_cached == self.num_free_cached_blocks, f"free cached count {self.num_free_cached_blocks} != {free_cached}"
