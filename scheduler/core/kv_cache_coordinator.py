"""The one-group KV-cache coordinator: vLLM's UnitaryKVCacheCoordinator, the block
tables of a model whose layers are all in one full-attention KV-cache group.

`KVCacheManager` (kv_cache_manager.py) asks it for a request's cached prefix, room for
the tokens about to be scheduled, and the request's blocks back; hybrid models' groups
have `HybridKVCacheCoordinator` (scheduler/core/hybrid/) instead, with the same calls.
Written for the decode fast path: one table per request, no per-group loop.

With a host tier (`scheduler/core/offload/offload_tier.py`) the cached prefix continues
in host memory after the device's: those blocks get fresh device blocks and a load in the
step's plan (`OffloadingConnector`). With an external tier (disk, Mooncake Store) the
blocks the step caches are written there too.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_blocks import NO_NEW_BLOCKS, KVCacheBlocks
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.offload.external_tier import ExternalTier
from scheduler.core.offload.offloading_connector import OffloadingConnector


class UnitaryKVCacheCoordinator:
    """One full-attention group: each request's table is one list of blocks."""

    num_groups = 1

    def __init__(self, block_pool: BlockPool, block_size: int, max_model_len: int, enable_caching: bool,
                 offloading_connector: OffloadingConnector | None = None, write_through: bool = False,
                 external: ExternalTier | None = None):
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.offloading_connector = offloading_connector
        self._write_through = write_through
        self.external = external
        # request_id -> its block table, in order (append-only while it runs).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many leading blocks of its table are cached (hashed).
        self.num_cached_block: dict[str, int] = {}
        # Fewest free blocks seen right after an allocation (KVCacheManager.min_num_free_blocks).
        self.min_num_free_blocks = block_pool.get_num_free_blocks()

    def find_longest_cache_hit(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int, int]:
        """The longest cached prefix of the request's full blocks (capped so its last token
        is computed), its length in tokens, and how many of those the host tier holds
        (they continue the device's hits; `allocate_slots` loads them)."""
        max_hit_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        get_one_block = self.block_pool.cached_block_hash_to_block.get_one_block
        hashes = request.block_hashes
        computed: list[KVCacheBlock] = []
        for i in range(max_hit_blocks):
            block = get_one_block(hashes[i])
            if block is None:
                break
            computed.append(block)
        num_hit_blocks = len(computed)
        if self.offloading_connector is not None and num_hit_blocks < max_hit_blocks:
            num_hit_blocks += self.offloading_connector.lookup(hashes[num_hit_blocks:max_hit_blocks])
        num_hit_tokens = num_hit_blocks * self.block_size
        return KVCacheBlocks((computed,)), num_hit_tokens, num_hit_tokens - len(computed) * self.block_size

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0, new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False, watermark_blocks: int = 0,
                       delay_cache: bool = False) -> KVCacheBlocks | None:
        """``KVCacheManager.allocate_slots`` for one group (its docstring is the contract)."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be >= 0")
        new_computed_blocks = () if new_computed_blocks is None else new_computed_blocks.blocks[0]
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        if new_computed_blocks and num_held:
            raise ValueError(f"request {request_id!r} already holds blocks; prefix hits only at admission")
        # Host-tier hits: the computed tokens past the device's hit blocks.
        num_host_hits = 0
        if num_new_computed_tokens > len(new_computed_blocks) * self.block_size:
            if self.offloading_connector is None:
                raise ValueError(f"request {request_id!r}: computed tokens beyond its device hits, but there is no host tier")
            num_host_hits = self.offloading_connector.get_num_hits(request, num_held, num_new_computed_tokens, len(new_computed_blocks))
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = self._get_num_blocks_to_allocate(request, num_tokens_need_slot, num_held, new_computed_blocks, full_sequence_must_fit, watermark_blocks)
        if num_new_blocks is None:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        new_blocks = self._add_blocks(request, req_blocks, new_computed_blocks, num_host_hits, num_new_blocks)
        num_final = num_computed_tokens if delay_cache else num_computed_tokens + num_new_tokens
        self._cache_and_bound(request, req_blocks, min(num_final, len(request.all_token_ids)))
        return KVCacheBlocks((new_blocks,)) if new_blocks else NO_NEW_BLOCKS

    def _get_num_blocks_to_allocate(self, request: KVCacheRequest, num_tokens_need_slot: int, num_held: int, new_computed_blocks: Sequence[KVCacheBlock], full_sequence_must_fit: bool, watermark_blocks: int) -> int | None:
        """The new blocks a table of ``num_held`` blocks plus the prefix hits needs for ``num_tokens_need_slot``
        tokens (0 or less: none), or None unless they fit with ``watermark_blocks`` left free."""
        num_new_blocks = -(-num_tokens_need_slot // self.block_size) - num_held - len(new_computed_blocks)
        # NOTE: a hit on a free block takes it out of the free queue, so those hits
        # are not free for this request's new blocks.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null) if new_computed_blocks else 0
        num_free = self.block_pool.free_block_queue.num_free_blocks - num_evictable_hits - watermark_blocks
        if num_new_blocks > num_free:
            return None
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            if -(-num_full // self.block_size) - num_held - len(new_computed_blocks) > num_free:
                return None
        return num_new_blocks

    def _add_blocks(self, request: KVCacheRequest, req_blocks: list[KVCacheBlock], new_computed_blocks: Sequence[KVCacheBlock], num_host_hits: int, num_new_blocks: int) -> list[KVCacheBlock]:
        """Append the prefix hits and ``num_new_blocks`` new blocks to the table; the
        first new blocks take the host hits, as loads. Returns the new blocks."""
        pool = self.block_pool
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            # Hits are cached already.
            self.num_cached_block[request.request_id] = len(req_blocks)
        if num_host_hits:
            # NOTE: pinned before the allocation below, whose evictions may need host
            # slots for their stores: those must not take the slots about to be read.
            first = len(new_computed_blocks)
            host_entries = self.offloading_connector.pin_hits(request.block_hashes[first : first + num_host_hits])
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            if pool.evicted:
                self.offloading_connector.store_evicted()
        else:
            new_blocks = []
        if num_host_hits:
            # The first new blocks take the host hits (their tokens are computed).
            self.offloading_connector.add_loads(host_entries, new_blocks[:num_host_hits])
        if pool.free_block_queue.num_free_blocks < self.min_num_free_blocks:
            self.min_num_free_blocks = pool.free_block_queue.num_free_blocks
        return new_blocks

    def allocate_next_slot(self, request: KVCacheRequest) -> KVCacheBlocks | None:
        """``allocate_slots(request, 1)`` for a running request (a decode step, or
        the last token of a chunked prompt): the same effect and result, without the
        general path's work. The scheduler calls it at every block boundary of
        every running request (twice a block: it fills, then the next is needed)."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        end = request.num_computed_tokens + 1
        if req_blocks is None or end > self.max_model_len:
            return self.allocate_slots(request, 1)
        # A running request holds blocks for its computed tokens: one more token needs
        # at most one more block.
        if end > len(req_blocks) * self.block_size:
            pool = self.block_pool
            if not pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = pool.get_new_blocks(1)
            req_blocks += new_blocks
            if pool.evicted:
                self.offloading_connector.store_evicted()
            if pool.free_block_queue.num_free_blocks < self.min_num_free_blocks:
                self.min_num_free_blocks = pool.free_block_queue.num_free_blocks
            self._cache_and_bound(request, req_blocks, min(end, len(request.all_token_ids)))
            return KVCacheBlocks((new_blocks,))
        self._cache_and_bound(request, req_blocks, min(end, len(request.all_token_ids)))
        return NO_NEW_BLOCKS

    def _cache_and_bound(self, request: KVCacheRequest, req_blocks: list[KVCacheBlock], num_final_tokens: int) -> None:
        """Cache (hash and register) the request's full blocks within its first
        ``num_final_tokens`` tokens (final, and computed or scheduled), and set
        request.alloc_noop_until."""
        block_size = self.block_size
        if not self.enable_caching:
            request.alloc_noop_until = len(req_blocks) * block_size
            return
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full_blocks = num_final_tokens // block_size
        if num_full_blocks > num_cached:
            self.block_pool.cache_full_blocks(
                req_blocks, request.block_hashes, num_cached, num_full_blocks, request.all_token_ids, block_size
            )
            if self._write_through:
                self.offloading_connector.add_written(req_blocks, request.block_hashes, num_cached, num_full_blocks)
            if self.external is not None:
                self.external.add_written(req_blocks, request.block_hashes, num_cached, num_full_blocks)
            self.num_cached_block[request_id] = num_cached = num_full_blocks
        # While its computed tokens stay at or below this, a call for this request would allocate
        # nothing (its blocks have room) and cache nothing (no block past the cached ones fills):
        # the scheduler skips the call (fast path).
        request.alloc_noop_until = min(len(req_blocks) * block_size, (num_cached + 1) * block_size - 1)

    def free(self, request: KVCacheRequest, num_computed_tokens: int | None = None) -> None:
        """Give back the request's blocks, last block first (its deepest are evicted
        first). ``num_computed_tokens``: a request preempted in the step that scheduled
        it; its blocks cached past that many tokens lose their hash (KV never written)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self.num_cached_block.pop(request.request_id, 0)
        request.alloc_noop_until = 0
        if blocks:
            if num_computed_tokens is not None and num_cached * self.block_size > num_computed_tokens:
                uncached = blocks[num_computed_tokens // self.block_size : num_cached]
                self.block_pool.uncache_blocks(uncached)
                if self._write_through:
                    self.offloading_connector.forget_written(uncached)
                if self.external is not None:
                    self.external.forget_written(uncached)
            # NOTE: last first, without reordering the table a caller may still hold (vLLM's).
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return ([b.block_id for b in self.req_to_blocks.get(request_id, ())],)

    def load_targets(self, request_id: str, first_block: int, num_blocks: int) -> list[tuple[int, int, KVCacheBlock]]:
        """(group 0, position, block) for table positions ``first_block`` .. + ``num_blocks``:
        where a load from outside writes (`HybridKVCacheCoordinator.load_targets`)."""
        blocks = self.req_to_blocks[request_id]
        return [(0, i, blocks[i]) for i in range(first_block, min(first_block + num_blocks, len(blocks)))]

    @staticmethod
    def keyed_hash(block_hash: BlockHash, group: int) -> BlockHash:
        """The key a tier holds group ``group``'s block of ``block_hash`` under: the hash itself."""
        return block_hash

    def take_nulled(self) -> tuple[()]:
        """No sliding window: no table entry is ever nulled."""
        return ()

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a new request of ``num_tokens`` tokens needs."""
        return -(-num_tokens // self.block_size)

    def cache_loaded(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """An external load ended: the request's first ``num_computed_tokens`` tokens are in
        its blocks; cache (hash) those full blocks, as if just computed."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None or num_computed_tokens > len(req_blocks) * self.block_size:
            raise ValueError(f"request {request.request_id!r}: {num_computed_tokens} loaded tokens, it holds room for fewer")
        self._cache_and_bound(request, req_blocks, min(num_computed_tokens, len(request.all_token_ids)))

    def req_to_blocks_per_group(self) -> list[dict[str, list[KVCacheBlock]]]:
        return [self.req_to_blocks]

    def has_requests(self) -> bool:
        return any(self.req_to_blocks.values())

    def held_blocks(self) -> list[list[KVCacheBlock]]:
        """Every request's table (for the invariant check)."""
        return list(self.req_to_blocks.values())

    # --- pins (scheduler/core/retention/pinned_blocks.py's PinTargets) ----------------

    def blocks_to_pin(self, block_hashes: Sequence[BlockHash],
                      num_tokens: int | None) -> tuple[list[tuple[BlockHash, KVCacheBlock]], int]:
        """Every block of the prefix, all cached; else ([], how many from the first uncached)."""
        get = self.block_pool.get_cached_block
        targets = []
        for i, block_hash in enumerate(block_hashes):
            block = get(block_hash)
            if block is None:
                return [], len(block_hashes) - i
            targets.append((block_hash, block))
        return targets, 0

    def pin_keys(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, ...]]:
        return [(h,) for h in block_hashes]
