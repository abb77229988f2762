"""KVCacheManager: request block tables over the BlockPool (one attention group).

The scheduler asks three things of it: which prefix of a request is already cached
(`get_computed_blocks`), room for the tokens it is about to schedule
(`allocate_slots`), and to give a request's blocks back (`free`).

With a host tier (`scheduler/core/offload_tier.py`, vLLM's --kv-offloading-size)
the cached prefix continues in host memory after the device's: those blocks get
fresh device blocks and a load in the step's plan. Which blocks go to the tier,
and when, is the `OffloadingConnector`'s (`scheduler/core/offloading_connector.py`).
The scheduler takes a step's copies with `take_tier_copies` and completes them
with `complete_tier_copies` once the step's result is in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.core.block_pool import BlockPool
from scheduler.core.external_tier import ExternalOps, ExternalTier
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.kv_events import KVEventSink
from scheduler.core.offload_tier import HostTier, HostTierCopies
from scheduler.core.offloading_connector import OffloadingConnector
from scheduler.core.pinned_blocks import PinnedBlocks
from scheduler.core.prefix_cache_stats import PrefixCacheStats

# (num_gpu_blocks, enable_caching, event_sink) -> the pool. BlockPool itself by
# default; what-if studies pass pools with other free-queue rules.
PoolFactory = Callable[[int, bool, "KVEventSink | None"], BlockPool]
# When blocks are copied to the host tier (--kv-offloading-store).
OFFLOAD_STORE_MODES = ("eviction", "full")


class KVCacheManager:
    # KV-cache groups: one (hybrid models: scheduler/core/hybrid_kv_cache_manager.py).
    num_groups = 1

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True, event_sink: KVEventSink | None = None,
                 pool_factory: PoolFactory = BlockPool, host_tier: HostTier | None = None, offload_store: str = "eviction",
                 max_pinned_fraction: float = 0.5, external_tier: ExternalTier | None = None):
        if offload_store not in OFFLOAD_STORE_MODES:
            raise ValueError(f"offload_store must be one of {OFFLOAD_STORE_MODES}, got {offload_store!r}")
        if host_tier is not None and host_tier.block_size != block_size:
            raise ValueError(f"the host tier's block size {host_tier.block_size} differs from the pool's {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = pool_factory(num_gpu_blocks, enable_caching, event_sink)
        # Pinned prefixes (POST /v1/cache/pin): pool-level owners of their blocks.
        self.pinned = PinnedBlocks(self.block_pool, int(max_pinned_fraction * (num_gpu_blocks - 1)))
        # request_id -> its block table, in order (append-only while it runs).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many leading blocks of its table are cached (hashed).
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # The host tier (None: no offloading). Without caching nothing is hashed,
        # so nothing could be stored or found: the tier is left out.
        self.host_tier = host_tier if enable_caching else None
        self.offload_store = offload_store
        self._write_through = self.host_tier is not None and offload_store == "full"
        self.offloading_connector = None if self.host_tier is None else OffloadingConnector(self.host_tier, self.block_pool, self._write_through)
        # The external tier (disk, Mooncake Store: scheduler/core/external_tier.py), below the host
        # tier; None without one (or without caching: nothing would be hashed).
        self.external = external_tier if enable_caching else None
        # vLLM's connector_prefix_cache_stats: tokens asked of the host tier (what the device did
        # not hold) and found there (vllm:external_prefix_cache_*).
        self.external_prefix_cache_stats = PrefixCacheStats()
        # Whether a KV connector (P/D disaggregation: scheduler/sched/pd_connector.py) is a source
        # of tokens too: then, as vLLM, the connector's stats are kept even with no tier.
        self.has_connector = False
        # Fewest free blocks seen right after an allocation: the peak of usage, which a poll between
        # steps misses (frees come at the end of every step); read by scheduler/core/kv_cache_usage.py.
        self.min_num_free_blocks = self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: KVCacheRequest, record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in
        tokens. Capped so the last prompt token is always computed: the worker needs
        its logits to sample the first output token.

        With a host tier the prefix continues there after the device's blocks: the
        length counts those too (a multiple of block_size beyond the returned
        device blocks), and `allocate_slots` loads them.

        ``record_stats=False`` lets a caller count the lookup only once it admits the
        request (`record_prefix_cache_query`), so a request that waits several steps
        for room is counted once. A request that skips reading the cache finds nothing
        and is not counted (vLLM's ``prefix_cache_lookup_enabled``)."""
        if not self.prefix_cache_lookup_enabled(request):
            return [], 0
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
        num_computed_tokens = num_hit_blocks * self.block_size
        if record_stats:
            num_host_hit_tokens = num_computed_tokens - len(computed) * self.block_size
            self.record_prefix_cache_query(request.num_tokens, num_computed_tokens, request.num_preemptions > 0, num_host_hit_tokens)
        return computed, num_computed_tokens

    def prefix_cache_lookup_enabled(self, request: KVCacheRequest) -> bool:
        """Whether a lookup may run for ``request`` (and count in the prefix-cache stats)."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int, preempted: bool = False, num_host_hit_tokens: int = 0) -> None:
        """Count one admission's lookup; ``preempted``: the request is resumed after
        a preemption (vLLM: ``request.num_preemptions > 0``), counted apart.

        ``num_host_hit_tokens`` of the ``num_hit_tokens`` came from the host tier.
        As vLLM counts them: prefix_cache_stats gets the device's hits only, and
        external_prefix_cache_stats the tokens the device did not hold, with the
        host tier's hits."""
        if not self.enable_caching:
            return
        num_local = num_hit_tokens - num_host_hit_tokens
        self.prefix_cache_stats.record(num_tokens, num_local, preempted)
        if self.host_tier is not None or self.external is not None or self.has_connector:
            self.external_prefix_cache_stats.record(num_tokens - num_local, num_host_hit_tokens, preempted)

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0, new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False, watermark_blocks: int = 0,
                       delay_cache: bool = False) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after its
        computed tokens and the ``new_computed_blocks`` prefix hits).

        Returns the newly allocated blocks (not the hits), or None — with nothing
        changed — when they do not fit. Then caches the request's full blocks up to
        min(computed + new, request.num_tokens): only final tokens are hashed.

        ``full_sequence_must_fit`` (vLLM's admission gate, ``scheduler_reserve_full_isl``):
        None unless the free blocks could also hold every token the request has now
        (prompt and output so far, up to max_model_len), not only this chunk. Both checks
        leave ``watermark_blocks`` free (vLLM's watermark: the scheduler's, for admissions).

        ``delay_cache`` (vLLM's ``delay_cache_blocks``): the new tokens are an external load's,
        not yet written: their blocks are cached by `cache_loaded` once the load is in."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if new_computed_blocks is None:
            new_computed_blocks = ()
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
        return new_blocks

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

    def allocate_next_slot(self, request: KVCacheRequest) -> list[KVCacheBlock] | None:
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
        else:
            new_blocks = []
        self._cache_and_bound(request, req_blocks, min(end, len(request.all_token_ids)))
        return new_blocks

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
            blocks.reverse()
            self.block_pool.free_blocks(blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    # --- the host tier -----------------------------------------------------------------

    def take_tier_copies(self) -> HostTierCopies | None:
        """The step's copies for its plan (None: none, or no tier); see `OffloadingConnector.take_copies`."""
        return None if self.offloading_connector is None else self.offloading_connector.take_copies()

    def complete_tier_copies(self) -> None:
        """The plan in flight ran: its copies are done."""
        if self.offloading_connector is not None:
            self.offloading_connector.complete_copies()

    # --- the external tier -------------------------------------------------------------

    def get_num_external_hits(self, request: KVCacheRequest, num_hit_tokens: int) -> int:
        """Tokens of the request's next blocks, after its ``num_hit_tokens`` device and host
        hits, that the external tier holds (vLLM's ``get_num_new_matched_tokens``); capped, as
        every hit, so the last prompt token is computed. 0 without a tier."""
        if self.external is None or not self.prefix_cache_lookup_enabled(request):
            return 0
        start = num_hit_tokens // self.block_size
        end = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        return self.external.lookup(request.block_hashes[start:end]) * self.block_size if end > start else 0

    def cache_loaded(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """An external load ended: the request's first ``num_computed_tokens`` tokens are in
        its blocks; cache (hash) those full blocks, as if just computed."""
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None or num_computed_tokens > len(req_blocks) * self.block_size:
            raise ValueError(f"request {request.request_id!r}: {num_computed_tokens} loaded tokens, it holds room for fewer")
        self._cache_and_bound(request, req_blocks, min(num_computed_tokens, len(request.all_token_ids)))

    def take_external_ops(self) -> ExternalOps | None:
        """The step's external saves and loads for its plan (None: none, or no tier)."""
        return None if self.external is None else self.external.take_ops()

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, on the device and in the host tier (vLLM's CPU tier
        keeps serving after a reset; here both go). Refused (False, nothing
        changed) while any request holds a block. Pins are released first (their
        blocks are the pool's own): ``self.pinned.num_cleared`` counts them."""
        if any(self.req_to_blocks.values()):
            return False
        self.pinned.clear()
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offloading_connector is not None:
            self.offloading_connector.clear()
        return True

    def check_invariants(self) -> None:
        """Pool invariants, plus: every held block's ref_cnt equals the number of
        tables holding it; the host tier's invariants, and each load of the step
        being planned goes to a held device block that holds the loaded hash."""
        self.block_pool.check_invariants()
        if self.offloading_connector is not None:
            self.offloading_connector.check_invariants()
        owners: dict[int, int] = {}
        for blocks in [*self.req_to_blocks.values(), self.pinned.blocks()]:
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            num_owners = owners.get(block.block_id, 0)
            assert block.ref_cnt == num_owners, f"block {block.block_id}: ref_cnt {block.ref_cnt}, in {num_owners} tables and pins"
