"""HybridKVCacheManager: the KV cache of a model whose layers are in several KV-cache
groups (sliding-window and full-attention layers; protocol.kv_cache_spec), over one
shared BlockPool: vLLM 0.32's KVCacheManager over its HybridKVCacheCoordinator
(``kv_cache_manager.py``, ``kv_cache_coordinator.py``).

The same public surface as `KVCacheManager` (one group, unchanged), with one list of
blocks per group (`GroupedBlocks`) where that returns one list:

* prefix hits: full attention's longest run from the start, then each sliding group
  within it (right to left), to the fixed point, as vLLM's coordinator; a lookup also
  sets the request's shared-prefix junction (vLLM's ``shared_prefix_boundary``);
* caching: full attention caches every full block; a sliding group only the tails
  vLLM serve's default retention (``--prefix-cache-retention-interval 0``) keeps
  (sliding_window_retention.py): at the replay boundary and at the junction;
* allocation: first the blocks the window has left behind are freed (a sliding group's
  leading entries become the null block, reported by `take_nulled` for the plan),
  then every group grows to the same length;
* free: group by group, each table last block first.

Not supported with hybrid groups (refused where the pool is built, by flag): the host
tier and an eviction policy other than LRU (LRU by priority class, under
--scheduling-policy priority, works: priority_retention.py); pins (`HybridPins` refuses
them).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.core.block_pool import BlockPool
from scheduler.core.group_events import GroupKeyedEventSink
from scheduler.core.grouped_blocks import GroupedBlocks
from scheduler.core.hybrid_cache_hit import HybridCacheHit
from scheduler.core.hybrid_pins import HybridPins
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_manager import PoolFactory
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.kv_events import KVEventSink
from scheduler.core.prefix_cache_stats import PrefixCacheStats
from scheduler.core.single_type_kv_cache_manager import (
    AttentionSpec,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
)


class HybridKVCacheManager:
    host_tier = None
    offloading_connector = None
    offload_store = "eviction"
    # No external tier for hybrid groups yet (the worker refuses one too).
    external = None

    def take_external_ops(self) -> None:
        return None

    def get_num_external_hits(self, request, num_hit_tokens: int) -> int:
        return 0

    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, group_windows: Sequence[int], enable_caching: bool = True,
                 event_sink: KVEventSink | None = None, pool_factory: PoolFactory = BlockPool, *, max_num_batched_tokens: int | None = None):
        if not group_windows or any(not isinstance(w, int) or w < 0 for w in group_windows):
            raise ValueError(
                f"group_windows: one window >= 0 per KV-cache group (0: full attention), got {list(group_windows)}"
            )
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.group_windows = list(group_windows)
        self.num_groups = len(group_windows)
        sink = None if event_sink is None else GroupKeyedEventSink(event_sink, self.group_windows)
        self.block_pool = pool_factory(num_gpu_blocks, enable_caching, sink)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            (FullAttentionManager if w == 0 else SlidingWindowManager)(AttentionSpec(block_size, w), self.block_pool, enable_caching, g)
            for g, w in enumerate(group_windows)
        )
        self.cache_hit = HybridCacheHit(self.single_type_managers, self.block_pool, block_size)
        # vLLM's admission cap of a sliding group (SlidingWindowSpec.max_admission_blocks_per_request,
        # one step in flight): its blocks plateau there, since the window's are freed before each chunk.
        num_in_flight = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        self.max_admission_blocks = [
            None if w == 0 else cdiv(min(w - 1 + num_in_flight, max_model_len), block_size) + 1
            for w in group_windows
        ]
        self.pinned = HybridPins()
        self.prefix_cache_stats = PrefixCacheStats()
        self.external_prefix_cache_stats = PrefixCacheStats()
        self.min_num_free_blocks = self.block_pool.get_num_free_blocks()
        # (request_id, group) -> leading null entries not yet reported (`take_nulled`).
        self._nulled: dict[tuple[str, int], int] = {}
        # request_id -> vLLM's request.shared_prefix_boundary (non-zero only), set by
        # the lookup at admission, read by every caching of the request, dropped by free.
        self.shared_prefix_boundary: dict[str, int] = {}

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a new request of ``num_tokens`` tokens needs in every group together, as
        the admission gate counts them: a sliding group's capped at its plateau."""
        n = cdiv(num_tokens, self.block_size)
        return sum(n if cap is None else min(n, cap) for cap in self.max_admission_blocks)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def _empty(self) -> GroupedBlocks:
        return GroupedBlocks(tuple([] for _ in range(self.num_groups)))

    # --- prefix hits ------------------------------------------------------------------

    def get_computed_blocks(
        self, request: KVCacheRequest, record_stats: bool = True
    ) -> tuple[GroupedBlocks, int]:
        """The longest prefix cached in every group (a sliding group needs only the
        blocks in the window of the prefix's end), and its length in tokens; capped so
        the last prompt token is computed. ``record_stats``: as `KVCacheManager`'s."""
        if not self.prefix_cache_lookup_enabled(request):
            self._set_shared_prefix_boundary(request.request_id, 0)
            return self._empty(), 0
        hashes = request.block_hashes
        max_length = min(request.num_tokens - 1, len(hashes) * self.block_size)
        hits, num_hit_tokens, num_uncached = self.find_longest_cache_hit(hashes, max_length)
        # vLLM's junction: where the longest single group's hit ended (the lagging
        # sliding groups' hit plus the prefix they have not cached), 0 if none lags.
        self._set_shared_prefix_boundary(
            request.request_id, num_hit_tokens + num_uncached if num_uncached else 0
        )
        if record_stats:
            self.record_prefix_cache_query(
                request.num_tokens, num_hit_tokens, request.num_preemptions > 0
            )
        return hits, num_hit_tokens

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[GroupedBlocks, int, int]:
        """The longest prefix of at most ``max_length`` tokens cached in every group,
        its length, and how much longer one group's own hit ran (vLLM's
        ``num_uncached_common_prefix_tokens``)."""
        return self.cache_hit.find(block_hashes, max_length)

    def _set_shared_prefix_boundary(self, request_id: str, boundary: int) -> None:
        # NOTE: vLLM looks up only a request without computed tokens; a lookup for a
        # request holding blocks (a probe) leaves its junction as it was.
        if request_id in self.single_type_managers[0].req_to_blocks:
            return
        if boundary:
            self.shared_prefix_boundary[request_id] = boundary
        else:
            self.shared_prefix_boundary.pop(request_id, None)

    def prefix_cache_lookup_enabled(self, request: KVCacheRequest) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_query(
        self,
        num_tokens: int,
        num_hit_tokens: int,
        preempted: bool = False,
        num_host_hit_tokens: int = 0,
    ) -> None:
        """Count one admission's lookup (queries: its tokens; hits: the hybrid hit)."""
        if self.enable_caching:
            self.prefix_cache_stats.record(
                num_tokens, num_hit_tokens - num_host_hit_tokens, preempted
            )

    # --- allocation -------------------------------------------------------------------

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: GroupedBlocks | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, watermark_blocks: int = 0) -> GroupedBlocks | None:
        """`KVCacheManager.allocate_slots`, group by group, as vLLM's: the blocks the
        window left behind are freed first (even when None is returned: they are
        freed for good), then every group's new blocks, or None when they do not fit."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be >= 0")
        request_id = request.request_id
        managers = self.single_type_managers
        held = request_id in managers[0].req_to_blocks
        hits = new_computed_blocks.groups if new_computed_blocks else None
        if hits is not None and held:
            raise ValueError(
                f"request {request_id!r} already holds blocks; prefix hits only at admission"
            )
        if num_new_computed_tokens > (len(new_computed_blocks) if hits else 0) * self.block_size:
            raise ValueError(
                f"request {request_id!r}: computed tokens beyond its prefix hits (no host tier with hybrid KV-cache groups)"
            )
        no_hits: tuple[list[KVCacheBlock], ...] = ((),) * self.num_groups
        group_hits = hits or no_hits
        num_computed_tokens = min(
            request.num_computed_tokens + num_new_computed_tokens, self.max_model_len
        )
        num_free = self.block_pool.free_block_queue.num_free_blocks
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            needed = sum(m.get_num_blocks_to_allocate(request_id, num_full, group_hits[g], num_computed_tokens, self.max_admission_blocks[g])
                         for g, m in enumerate(managers))
            if needed + watermark_blocks > num_free:
                return None
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        self._remove_skipped_blocks(request_id, num_computed_tokens)
        needed = sum(m.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, group_hits[g], num_computed_tokens)
                     for g, m in enumerate(managers))
        if needed + watermark_blocks > self.block_pool.free_block_queue.num_free_blocks:
            return None
        if hits is not None:
            for g, m in enumerate(managers):
                m.add_local_computed_blocks(request_id, hits[g], num_computed_tokens)
        new_blocks = GroupedBlocks(
            tuple(m.allocate_new_blocks(request_id, num_tokens_need_slot) for m in managers)
        )
        if self.enable_caching:
            num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
            # vLLM's reachable boundaries: the replay boundary and the junction (0: none,
            # which retains nothing).
            boundaries = (
                request.num_prompt_tokens - 1,
                self.shared_prefix_boundary.get(request_id, 0),
            )
            for m in managers:
                m.cache_blocks(request, num_tokens_to_cache, boundaries)
        num_free = self.block_pool.free_block_queue.num_free_blocks
        if num_free < self.min_num_free_blocks:
            self.min_num_free_blocks = num_free
        self._set_alloc_noop_until(request)
        return new_blocks

    def allocate_next_slot(self, request: KVCacheRequest) -> GroupedBlocks | None:
        """``allocate_slots(request, 1)`` (the scheduler's decode call)."""
        return self.allocate_slots(request, 1)

    def _remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        nulled = self._nulled
        for m in self.single_type_managers:
            if m.sliding_window:
                before = m.num_null_blocks(request_id)
                after = m.remove_skipped_blocks(request_id, num_computed_tokens)
                if after > before:
                    nulled[request_id, m.group_id] = after

    def _set_alloc_noop_until(self, request: KVCacheRequest) -> None:
        """While its computed tokens stay at or below this, a call would allocate, cache
        and free nothing: every group's blocks have room, no block past the cached ones
        fills, and no sliding group's window leaves a block behind."""
        bs = self.block_size
        bound = None
        for m in self.single_type_managers:
            blocks = m.req_to_blocks[request.request_id]
            b = len(blocks) * bs
            if self.enable_caching:
                b = min(b, (m.num_cached_block.get(request.request_id, 0) + 1) * bs - 1)
            if m.sliding_window:
                # A call at c computed tokens frees block k once c - W + 1 >= (k + 1) * bs.
                k = m.num_null_blocks(request.request_id)
                b = min(b, (k + 1) * bs + m.sliding_window - 1)
            bound = b if bound is None else min(bound, b)
        request.alloc_noop_until = bound

    # --- free -------------------------------------------------------------------------

    def free(self, request: KVCacheRequest, num_computed_tokens: int | None = None) -> None:
        """Give back the request's blocks, group by group, each table last block first.
        ``num_computed_tokens``: as `KVCacheManager.free` (hashes past it are dropped)."""
        request_id = request.request_id
        request.alloc_noop_until = 0
        self.shared_prefix_boundary.pop(request_id, None)
        for m in self.single_type_managers:
            self._nulled.pop((request_id, m.group_id), None)
            if num_computed_tokens is not None:
                blocks = m.req_to_blocks.get(request_id)
                num_cached = m.num_cached_block.get(request_id, 0)
                if blocks and num_cached * self.block_size > num_computed_tokens:
                    self.block_pool.uncache_blocks(
                        blocks[num_computed_tokens // self.block_size : num_cached]
                    )
            m.free(request_id)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's table in every group (the null block is 0)."""
        return [
            [b.block_id for b in m.req_to_blocks.get(request_id, ())]
            for m in self.single_type_managers
        ]

    def take_nulled(self) -> list[tuple[str, int, int]]:
        """(request_id, group, leading null entries) for every live request and group
        whose leading null entries grew since the last call."""
        nulled, self._nulled = self._nulled, {}
        return [(request_id, group, n) for (request_id, group), n in nulled.items()]

    # --- what KVCacheManager also answers ---------------------------------------------

    def take_tier_copies(self) -> None:
        return None

    def complete_tier_copies(self) -> None:
        return None

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; refused (False) while any request holds a block."""
        if any(m.req_to_blocks for m in self.single_type_managers):
            return False
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool invariants, plus: each held block's ref_cnt is the number of tables
        holding it (null entries own nothing); a request's tables are equally long in
        every group; a table's null entries are exactly its leading ones (none in a
        full-attention group)."""
        self.block_pool.check_invariants()
        owners: dict[int, int] = {}
        lengths: dict[str, int] = {}
        for m in self.single_type_managers:
            for request_id, blocks in m.req_to_blocks.items():
                assert lengths.setdefault(request_id, len(blocks)) == len(blocks), (
                    f"{request_id}: tables of unequal length"
                )
                assert m.num_cached_block.get(request_id, 0) <= len(blocks)
                num_null = m.num_null_blocks(request_id)
                assert all(b.is_null for b in blocks[:num_null]), (
                    f"{request_id}: a leading entry not null (group {m.group_id})"
                )
                assert not any(b.is_null for b in blocks[num_null:]), (
                    f"{request_id}: a null entry after a block (group {m.group_id})"
                )
                for b in blocks[num_null:]:
                    owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            num_owners = owners.get(block.block_id, 0)
            assert block.ref_cnt == num_owners, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, in {num_owners} tables"
            )
