"""FreeKVCacheBlockQueue: a doubly linked list threaded through the blocks.

A deque cannot remove from the middle in O(1), and a cache hit on a free block
does exactly that. So the links live in the blocks themselves, and no Python
object is allocated while the list is manipulated. Two sentinels (id -1) sit at
the ends so that no operation tests for an empty list.

The queue's order *is* the eviction policy: the front is reused first.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from scheduler.core.kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Take the front block, ref_cnt untouched (how the pool sets the null block apart)."""
        head = self.fake_free_list_head
        block = head.next_free_block
        if block is self.fake_free_list_tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the n front blocks, front first, each with its first owner (ref_cnt 1):
        the queue holds the blocks nobody holds (see acquire and release)."""
        # NOTE: a negative n would pop nothing yet raise num_free_blocks.
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks: only {self.num_free_blocks} free")
        head = self.fake_free_list_head
        block = head.next_free_block
        out = []
        append = out.append
        for _ in range(n):
            append(block)
            block.ref_cnt = 1
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        head.next_free_block = block
        block.prev_free_block = head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink a block from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() called on block {block.block_id}, which is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put a block at the back (reused last)."""
        self.append_n((block,))

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the back, in the given order (the last given is reused last)."""
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None, "prev_free_block of fake_free_list_tail should always exist"
        self._insert_after(last, blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put blocks at the front, in the given order (the first given is reused first)."""
        self._insert_after(self.fake_free_list_head, blocks)

    def _insert_after(self, prev: KVCacheBlock, blocks: Sequence[KVCacheBlock]) -> None:
        """Link ``blocks``, in order, between ``prev`` and its successor."""
        if not blocks:
            return
        nxt = prev.next_free_block
        assert nxt is not None, "a linked block in the free queue always has a successor"
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks, front first (tests; O(n))."""
        return list(self)

    # --- owners come and go -------------------------------------------------------
    # The queue holds exactly the blocks nobody holds (ref_cnt 0; never the null
    # block), so the two operations that add an owner to a block or take its last
    # one move it across that line too, in one pass, with no list built on the way.

    def acquire(self, blocks: Iterable[KVCacheBlock]) -> int:
        """One more owner for each block (a cache hit); a block that had none leaves
        the queue, wherever it is, in O(1). Returns how many left the queue."""
        num_removed = 0
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                prev, nxt = block.prev_free_block, block.next_free_block
                if prev is None or nxt is None:
                    self.num_free_blocks -= num_removed
                    raise RuntimeError(f"free block {block.block_id} is not in the free queue")
                prev.next_free_block = nxt
                nxt.prev_free_block = prev
                block.prev_free_block = block.next_free_block = None
                num_removed += 1
            block.ref_cnt += 1
        self.num_free_blocks -= num_removed
        return num_removed

    def release(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        """One owner fewer for each block; a block left with none joins the queue, in
        the given order: without a hash at the front (it can never be hit: reuse it
        first, LIFO, which keeps the device's caches warm), with one at the back
        (cached data: least recently used first). Returns how many joined with a hash."""
        front = self.fake_free_list_head
        tail = self.fake_free_list_tail
        num_freed = num_hashed = 0
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt or block.is_null:
                continue
            num_freed += 1
            if block.block_hash is None:
                nxt = front.next_free_block
                block.prev_free_block = front
                block.next_free_block = nxt
                front.next_free_block = block
                nxt.prev_free_block = block
                front = block
            else:
                last = tail.prev_free_block
                block.prev_free_block = last
                block.next_free_block = tail
                last.next_free_block = block
                tail.prev_free_block = block
                num_hashed += 1
        self.num_free_blocks += num_freed
        return num_hashed

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.fake_free_list_head.next_free_block
        tail = self.fake_free_list_tail
        while block is not tail:
            yield block
            block = block.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks
