"""The many-group KV-cache coordinator: vLLM's HybridKVCacheCoordinator, the block tables
of a model whose layers are in several KV-cache groups (sliding-window and full-attention
layers; protocol.kv_cache_spec) over one shared BlockPool, one `SingleTypeKVCacheManager`
per group. `KVCacheManager` asks it what it asks `UnitaryKVCacheCoordinator`:

* prefix hits: full attention's longest run from the start, then each sliding group
  within it (right to left), to the fixed point (hybrid_cache_hit.py); a lookup also
  sets the request's shared-prefix junction (vLLM's ``shared_prefix_boundary``);
* caching: full attention caches every full block; a sliding group only the tails
  vLLM serve's default retention (``--prefix-cache-retention-interval 0``) keeps
  (sliding_window_retention.py): at the replay boundary and at the junction;
* allocation: first the blocks the window has left behind are freed (a sliding group's
  leading entries become the null block, reported by `take_nulled` for the plan),
  then every group grows to the same length;
* tiers: a host or external hit continues the device's in every group (hybrid_tier_hit.py);
* free: group by group, each table last block first.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.core.block_pool import BlockPool
from scheduler.core.hybrid.hybrid_cache_hit import HybridCacheHit
from scheduler.core.hybrid.hybrid_invariants import check_group_tables
from scheduler.core.hybrid.hybrid_tier_hit import HostTierSide, HybridTiers, TierSaves
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_blocks import KVCacheBlocks
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.single_type_kv_cache_manager import (
    AttentionSpec,
    FullAttentionManager,
    KeyedHashes,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    cdiv,
    group_key,
)


class HybridKVCacheCoordinator:
    def __init__(self, block_pool: BlockPool, block_size: int, max_model_len: int, group_windows: Sequence[int],
                 enable_caching: bool, max_num_batched_tokens: int | None = None,
                 offloading_connector: HostTierSide | None = None, write_through: bool = False,
                 external: TierSaves | None = None):
        self.block_pool = block_pool
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.num_groups = len(group_windows)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            (FullAttentionManager if w == 0 else SlidingWindowManager)(AttentionSpec(block_size, w), self.block_pool, enable_caching, g)
            for g, w in enumerate(group_windows)
        )
        # Group 0's tables: which requests hold blocks (every group holds the same requests).
        self.req_to_blocks = self.single_type_managers[0].req_to_blocks
        self.cache_hit = HybridCacheHit(self.single_type_managers, self.block_pool, block_size)
        # vLLM's admission cap of a sliding group (SlidingWindowSpec.max_admission_blocks_per_request,
        # one step in flight): its blocks plateau there, since the window's are freed before each chunk.
        num_in_flight = max_model_len if max_num_batched_tokens is None else max_num_batched_tokens
        self.max_admission_blocks = [
            None if w == 0 else cdiv(min(w - 1 + num_in_flight, max_model_len), block_size) + 1
            for w in group_windows
        ]
        self.min_num_free_blocks = self.block_pool.get_num_free_blocks()
        # (request_id, group) -> leading null entries not yet reported (`take_nulled`).
        self._nulled: dict[tuple[str, int], int] = {}
        # request_id -> vLLM's request.shared_prefix_boundary (non-zero only), set by
        # the lookup at admission, read by every caching of the request, dropped by free.
        self.shared_prefix_boundary: dict[str, int] = {}
        # request_id -> where its tier hit (host or external) ended, a boundary its caching keeps.
        self.tier_hit_end: dict[str, int] = {}
        self.tiers = HybridTiers(group_windows, block_size, offloading_connector, write_through, external)

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a new request of ``num_tokens`` tokens needs in every group together, as
        the admission gate counts them: a sliding group's capped at its plateau."""
        n = cdiv(num_tokens, self.block_size)
        return sum(n if cap is None else min(n, cap) for cap in self.max_admission_blocks)

    def find_longest_cache_hit(self, request: KVCacheRequest) -> tuple[KVCacheBlocks, int, int]:
        """The longest prefix cached in every group (a sliding group needs only the blocks
        in the window of the prefix's end), capped so the last prompt token is computed,
        then continued in the host tier (`find_tier_hit`); its length in tokens, and how
        many of those the host tier holds (`allocate_slots` loads them)."""
        hashes, bs = request.block_hashes, self.block_size
        max_length = min(request.num_tokens - 1, len(hashes) * bs)
        hits, num_hit_tokens, num_uncached = self.cache_hit.find(hashes, max_length)
        # vLLM's junction: where the longest single group's hit ended (the lagging
        # sliding groups' hit plus the prefix they have not cached), 0 if none lags.
        self.set_shared_prefix_boundary(request.request_id, num_hit_tokens + num_uncached if num_uncached else 0)
        num_host_hit_tokens = self.tiers.host_hit(hashes, num_hit_tokens // bs, max_length // bs) * bs - num_hit_tokens
        return hits, num_hit_tokens + num_host_hit_tokens, num_host_hit_tokens

    def blocks_to_pin(self, block_hashes: Sequence[BlockHash],
                      num_tokens: int | None) -> tuple[list[tuple[BlockHash, KVCacheBlock]], int]:
        """A pin's blocks in every group (`HybridCacheHit.blocks_to_pin`)."""
        return self.cache_hit.blocks_to_pin(block_hashes, num_tokens)

    def pin_keys(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, ...]]:
        return self.cache_hit.pin_keys(block_hashes)

    def set_shared_prefix_boundary(self, request_id: str, boundary: int) -> None:
        # NOTE: vLLM looks up only a request without computed tokens; a lookup for a
        # request holding blocks (a probe) leaves its junction as it was.
        if request_id in self.single_type_managers[0].req_to_blocks:
            return
        if boundary:
            self.shared_prefix_boundary[request_id] = boundary
        else:
            self.shared_prefix_boundary.pop(request_id, None)

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False, watermark_blocks: int = 0,
                       delay_cache: bool = False) -> KVCacheBlocks | None:
        """`UnitaryKVCacheCoordinator.allocate_slots`, group by group, as vLLM's: the blocks the
        window left behind are freed first (even when None is returned: they are
        freed for good), then every group's new blocks, or None when they do not fit.
        Computed tokens past the device hits are host-tier hits, and ``delay_cache``'s new
        tokens an external load's: a sliding group's entries outside the window of their end
        are null, the others get new blocks (host hits a load each, pinned first)."""
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be >= 0")
        request_id, bs = request.request_id, self.block_size
        managers = self.single_type_managers
        held = request_id in managers[0].req_to_blocks
        hits = new_computed_blocks.blocks if new_computed_blocks else None
        if hits is not None and held:
            raise ValueError(
                f"request {request_id!r} already holds blocks; prefix hits only at admission"
            )
        num_hit_blocks = len(new_computed_blocks) if hits else 0
        num_computed_tokens = min(
            request.num_computed_tokens + num_new_computed_tokens, self.max_model_len
        )
        # NOTE: a load's tokens are as good as computed for the window: the blocks behind the
        # window of its end are null, not loaded (of the last prompt token's, which a whole
        # prompt loaded computes again).
        num_window_tokens = (max(num_computed_tokens, min(num_computed_tokens + num_new_tokens, request.num_tokens - 1, self.max_model_len))
                             if delay_cache else num_computed_tokens)
        host_keys = None
        if num_new_computed_tokens > num_hit_blocks * bs:
            host_keys = self.tiers.host_load_keys(request, held, num_new_computed_tokens, num_hit_blocks, num_window_tokens)
        group_hits = hits or ((),) * self.num_groups
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        if not self._fits(request, group_hits, num_window_tokens, num_tokens_need_slot, full_sequence_must_fit, watermark_blocks):
            return None
        host_entries = self.tiers.connector.pin_hits(host_keys) if host_keys else None
        if not held and (hits is not None or num_window_tokens):
            for g, m in enumerate(managers):
                m.add_local_computed_blocks(request_id, group_hits[g], num_window_tokens)
        new_blocks = KVCacheBlocks(
            tuple(m.allocate_new_blocks(request_id, num_tokens_need_slot) for m in managers)
        )
        if self.block_pool.evicted:
            self.tiers.store_evicted()
        if host_entries:
            num_host_blocks = num_computed_tokens // bs - num_hit_blocks
            targets = self.load_targets(request_id, num_hit_blocks, num_host_blocks)
            self.tiers.connector.add_loads(host_entries, [b for _, _, b in targets])
        if host_keys is not None or delay_cache:
            # The tail a tier hit resumes at is reachable: its loaded blocks are cached too.
            self.tier_hit_end[request_id] = num_window_tokens
        if self.enable_caching:
            self._cache(request, min(num_computed_tokens + (0 if delay_cache else num_new_tokens), request.num_tokens))
        num_free = self.block_pool.free_block_queue.num_free_blocks
        if num_free < self.min_num_free_blocks:
            self.min_num_free_blocks = num_free
        self._set_alloc_noop_until(request)
        return new_blocks

    def _fits(self, request: KVCacheRequest, group_hits: Sequence[Sequence[KVCacheBlock]], num_window_tokens: int,
              num_tokens_need_slot: int, full_sequence_must_fit: bool, watermark_blocks: int) -> bool:
        """Whether the pool holds the new blocks (and, ``full_sequence_must_fit``, the whole
        sequence's) with ``watermark_blocks`` left free; frees the blocks the window left
        behind first (for good, fit or not) unless the whole sequence does not fit."""
        request_id, managers = request.request_id, self.single_type_managers
        if full_sequence_must_fit:
            num_full = min(request.num_tokens, self.max_model_len)
            needed = sum(m.get_num_blocks_to_allocate(request_id, num_full, group_hits[g], num_window_tokens, self.max_admission_blocks[g])
                         for g, m in enumerate(managers))
            if needed + watermark_blocks > self.block_pool.free_block_queue.num_free_blocks:
                return False
        self._remove_skipped_blocks(request_id, num_window_tokens)
        needed = sum(m.get_num_blocks_to_allocate(request_id, num_tokens_need_slot, group_hits[g], num_window_tokens)
                     for g, m in enumerate(managers))
        return needed + watermark_blocks <= self.block_pool.free_block_queue.num_free_blocks

    def _cache(self, request: KVCacheRequest, num_tokens: int) -> None:
        """Cache every group's full blocks within the first ``num_tokens`` tokens (a sliding
        group's at vLLM's reachable boundaries: the replay boundary, the junction, and here
        the end of a tier hit; 0: none); what is cached goes to the tiers that save it."""
        request_id = request.request_id
        boundaries = (
            request.num_prompt_tokens - 1,
            self.shared_prefix_boundary.get(request_id, 0),
            self.tier_hit_end.get(request_id, 0),
        )
        for m in self.single_type_managers:
            runs = m.cache_blocks(request, num_tokens, boundaries)
            if runs and self.tiers.saves:
                self.tiers.add_written(m.req_to_blocks[request_id], KeyedHashes(request.block_hashes, m.suffix), runs)

    def allocate_next_slot(self, request: KVCacheRequest) -> KVCacheBlocks | None:
        return self.allocate_slots(request, 1)  # the scheduler's decode call

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
        ``num_computed_tokens``: as `UnitaryKVCacheCoordinator.free` (hashes past it are dropped)."""
        request_id = request.request_id
        request.alloc_noop_until = 0
        self.shared_prefix_boundary.pop(request_id, None)
        self.tier_hit_end.pop(request_id, None)
        for m in self.single_type_managers:
            self._nulled.pop((request_id, m.group_id), None)
            if num_computed_tokens is not None:
                blocks = m.req_to_blocks.get(request_id)
                num_cached = m.num_cached_block.get(request_id, 0)
                if blocks and num_cached * self.block_size > num_computed_tokens:
                    uncached = blocks[num_computed_tokens // self.block_size : num_cached]
                    self.block_pool.uncache_blocks(uncached)
                    if self.tiers.saves:
                        self.tiers.forget_written(uncached)
            m.free(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's table in every group (the null block is 0)."""
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.single_type_managers)

    def load_targets(self, request_id: str, first_block: int, num_blocks: int) -> list[tuple[int, int, KVCacheBlock]]:
        """(group, position, block) for every group's table entries at positions ``first_block``
        .. + ``num_blocks`` that are not null (a sliding group holds only its window's): where a
        load from outside writes. Position by position, groups in order within one."""
        tables = [m.req_to_blocks[request_id] for m in self.single_type_managers]
        return [(g, i, table[i]) for i in range(first_block, first_block + num_blocks)
                for g, table in enumerate(tables) if i < len(table) and not table[i].is_null]

    @staticmethod
    def keyed_hash(block_hash: BlockHash, group: int) -> BlockHash:
        """The key a tier holds group ``group``'s block of ``block_hash`` under (the pool's own)."""
        return block_hash + group_key(group)

    def take_nulled(self) -> list[tuple[str, int, int]]:
        """(request_id, group, leading null entries) for every live request and group
        whose leading null entries grew since the last call."""
        nulled, self._nulled = self._nulled, {}
        return [(request_id, group, n) for (request_id, group), n in nulled.items()]

    def cache_loaded(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """An external load ended: the request's first ``num_computed_tokens`` tokens are in
        its blocks; cache each group's, as if just computed (a sliding group's kept tails)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None or num_computed_tokens > len(blocks) * self.block_size:
            raise ValueError(f"request {request.request_id!r}: {num_computed_tokens} loaded tokens, it holds room for fewer")
        if self.enable_caching:
            self._cache(request, min(num_computed_tokens, request.num_tokens))
        self._set_alloc_noop_until(request)

    def req_to_blocks_per_group(self) -> list[dict[str, list[KVCacheBlock]]]:
        """Each group's tables (a sliding group's null entries included)."""
        return [m.req_to_blocks for m in self.single_type_managers]

    def has_requests(self) -> bool:
        return any(m.req_to_blocks for m in self.single_type_managers)

    def held_blocks(self) -> list[list[KVCacheBlock]]:
        """Every table's blocks, null entries left out, once checked (`check_group_tables`)."""
        return check_group_tables(self.single_type_managers)
