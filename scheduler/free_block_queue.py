"""FreeKVCacheBlockQueue: a doubly linked list threaded through the blocks.

A deque cannot remove from the middle in O(1), and a cache hit on a free block
does exactly that. So the links live in the blocks themselves, and no Python
object is allocated while the list is manipulated. Two sentinels (id -1) sit at
the ends so that no operation tests for an empty list.

The queue's order *is* the eviction policy: the front is reused first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from scheduler.kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Take the front block (the next to reuse)."""
        head = self.fake_free_list_head
        block = head.next_free_block
        if block is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        nxt = block.next_free_block
        head.next_free_block = nxt
        nxt.prev_free_block = head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the n front blocks, front first."""
        if n == 0:
            return []
        # NOTE: a negative n would pop nothing yet raise num_free_blocks.
        if not 0 < n <= self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        head = self.fake_free_list_head
        block = head.next_free_block
        out = []
        append = out.append
        for _ in range(n):
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1) (a cache hit on a free block)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on block {block.block_id}, which is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back (reused last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the back, in the given order (the last given is reused last)."""
        if not blocks:
            return
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = tail
        tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the front, in the given order (the first given is reused first)."""
        if not blocks:
            return
        head = self.fake_free_list_head
        first = head.next_free_block
        prev = head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            yield block
            block = block.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)

    def __len__(self) -> int:
        return self.num_free_blocks
