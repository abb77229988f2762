"""The free queue and pool for an eviction policy other than LRU.

`PolicyFreeBlockQueue` answers every call the pool makes of the free queue. Free
blocks without a hash stay in the inherited linked list (front first, LIFO on
release, as with LRU: they can never be hit); free blocks with a hash are held by
the `BlockPolicy`, which alone decides the next victim. ``popleft_n`` takes the
list's blocks first, then the policy's victims. ``num_free_blocks`` counts both.

`policy_pool_class` mixes the queue into a pool class (the plain `BlockPool`, or
the residency pool of ``--kv-cache-metrics``): the mixin tells the policy when a
block gets its hash (and its parent, for ``cost``), and moves every free block
back to the list when a reset drops the hashes. The LRU pool is the plain one:
none of this is on its path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from scheduler.core.block_pool import BlockPool
from scheduler.core.free_block_queue import FreeKVCacheBlockQueue
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.retention.block_policy import BlockPolicy


class PolicyFreeBlockQueue(FreeKVCacheBlockQueue):
    def __init__(self, blocks: Sequence[KVCacheBlock], policy: BlockPolicy) -> None:
        super().__init__(blocks)
        self.policy = policy

    @property
    def num_uncached_free_blocks(self) -> int:
        return self.num_free_blocks - len(self.policy)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if not 0 <= n <= self.num_free_blocks:
            raise ValueError(f"Cannot get {n} free blocks: only {self.num_free_blocks} free")
        num_list = min(n, self.num_uncached_free_blocks)
        out = super().popleft_n(num_list)
        if num_list < n:
            evict = self.policy.evict
            for _ in range(n - num_list):
                block = evict()
                block.ref_cnt = 1
                out.append(block)
            self.num_free_blocks -= n - num_list
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            super().remove(block)
        else:
            self.policy.remove(block)
            self.num_free_blocks -= 1

    def acquire(self, blocks: Iterable[KVCacheBlock]) -> int:
        policy = self.policy
        on_hit, remove = policy.on_hit, policy.remove
        num_removed = 0
        for block in blocks:
            if block.is_null:
                block.ref_cnt += 1  # NOTE: as the LRU queue counts it (release takes it back)
                continue
            on_hit(block)
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    raise RuntimeError(f"free block {block.block_id} holds no hash: it cannot be hit")
                remove(block)
                num_removed += 1
            block.ref_cnt += 1
        self.num_free_blocks -= num_removed
        return num_removed

    def release(self, ordered_blocks: Iterable[KVCacheBlock]) -> int:
        insert = self.policy.insert
        front = self.fake_free_list_head
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
                insert(block)
                num_hashed += 1
        self.num_free_blocks += num_freed
        return num_hashed

    def uncache_all(self) -> None:
        """Every hash was dropped (a reset): the policy's blocks join the list."""
        blocks = list(self.policy)
        self.policy.clear()
        self.num_free_blocks -= len(blocks)
        self.append_n(blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from super().__iter__()
        yield from self.policy


class PolicyPoolMixin:
    """Put before a `BlockPool` class in the bases (see `policy_pool_class`)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True, event_sink=None, *, policy: BlockPolicy, **kwargs) -> None:
        super().__init__(num_gpu_blocks, enable_caching, event_sink, **kwargs)
        # NOTE: the base built a plain queue (and took the null block out of it);
        # the same free blocks, none hashed yet, go to the policy's queue.
        self.free_block_queue = PolicyFreeBlockQueue(list(self.free_block_queue), policy)
        self.policy = policy

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[BlockHash], num_cached_blocks: int, num_full_blocks: int,
                          token_ids: Sequence[int] | None = None, block_size: int = 0) -> None:
        super().cache_full_blocks(blocks, block_hashes, num_cached_blocks, num_full_blocks, token_ids, block_size)
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        on_cached = self.policy.on_cached
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if not block.is_null:
                on_cached(block, blocks[i - 1] if i else None)

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        blocks = [b for b in blocks if b.block_hash is not None]
        super().uncache_blocks(blocks)
        for block in blocks:
            self.policy.on_uncached(block)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self.free_block_queue.uncache_all()
        return True

    def check_invariants(self) -> None:
        # NOTE: the base walks the list; the policy's blocks are off it, so each is
        # checked here, and the base's count of the list is given the policy's share.
        queue = self.free_block_queue
        in_policy = list(queue.policy)
        assert len(in_policy) == len(queue.policy) == len({b.block_id for b in in_policy})
        for block in in_policy:
            assert block.ref_cnt == 0 and not block.is_null, f"block {block.block_id} in the policy but held"
            assert block.block_hash is not None, f"block {block.block_id} in the policy without a hash"
            assert block.prev_free_block is None and block.next_free_block is None
        listed = queue.num_free_blocks
        queue.num_free_blocks = listed - len(in_policy)
        try:
            for block in FreeKVCacheBlockQueue.__iter__(queue):
                assert block.block_hash is None, f"block {block.block_id} holds a hash but sits in the list"
            _check_list_and_counts(self, in_policy)
        finally:
            queue.num_free_blocks = listed


def _check_list_and_counts(pool: BlockPool, in_policy: list[KVCacheBlock]) -> None:
    """The base pool's checks, with the policy's blocks counted as free."""
    saved = {}
    # The base asserts that a block off the list is held; the policy's are free.
    for block in in_policy:
        saved[block.block_id] = block.ref_cnt
        block.ref_cnt = 1
    free_cached = pool.num_free_cached_blocks
    pool.num_free_cached_blocks = free_cached - len(in_policy)
    try:
        BlockPool.check_invariants(pool)
    finally:
        pool.num_free_cached_blocks = free_cached
        for block in in_policy:
            block.ref_cnt = saved[block.block_id]


def policy_pool_class(base: type[BlockPool] = BlockPool) -> type[BlockPool]:
    """``base`` with its free queue ordered by a policy (the pool takes ``policy=``)."""
    return type(f"Policy{base.__name__}", (PolicyPoolMixin, base), {})


def policy_pool_factory(make_policy: Callable[[int], BlockPolicy], base: Callable[..., BlockPool] = BlockPool) -> Callable[..., BlockPool]:
    """A `KVCacheManager` pool_factory: ``base`` (a pool class, or a partial of one)
    with a fresh policy from ``make_policy(num_gpu_blocks)``."""
    base_class = getattr(base, "func", base)
    base_kwargs = getattr(base, "keywords", {})
    cls = policy_pool_class(base_class)

    def factory(num_gpu_blocks: int, enable_caching: bool = True, event_sink=None) -> BlockPool:
        return cls(num_gpu_blocks, enable_caching, event_sink, policy=make_policy(num_gpu_blocks), **base_kwargs)

    return factory
