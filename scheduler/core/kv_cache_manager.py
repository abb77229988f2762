"""KVCacheManager: request block tables over the BlockPool, for a model of one KV-cache
group or of several (vLLM's KVCacheManager over its coordinator).

The scheduler asks three things of it: which prefix of a request is already cached
(`get_computed_blocks`), room for the tokens it is about to schedule
(`allocate_slots`), and to give a request's blocks back (`free`). Blocks come back as
`KVCacheBlocks`, one list per group. The block work is the coordinator's:
`UnitaryKVCacheCoordinator` for one full-attention group (every model before hybrid
groups, and the decode fast path's), `HybridKVCacheCoordinator` for several; the
manager keeps what does not depend on the groups: the prefix-cache stats, pins, the
host and external tiers' surface, the reset.

With a host tier (`scheduler/core/offload/offload_tier.py`, vLLM's --kv-offloading-size)
the cached prefix continues in host memory after the device's: those blocks get
fresh device blocks and a load in the step's plan. Which blocks go to the tier,
and when, is the `OffloadingConnector`'s (`scheduler/core/offload/offloading_connector.py`).
The scheduler takes a step's copies with `take_tier_copies` and completes them
with `complete_tier_copies` once the step's result is in.

Pins (`PinnedBlocks`) and both tiers are one implementation for one group and many: the
coordinator names the pool blocks a prompt's hashes pin, and a tier holds each group's
block under its group-keyed hash (`keyed_hash`), so a copy by block id serves any group;
with several groups a tier hit continues the device's in every group the hit needs
(scheduler/core/hybrid/hybrid_tier_hit.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from protocol.kv_cache_spec import is_hybrid
from scheduler.core.block_pool import BlockPool
from scheduler.core.hybrid.group_events import GroupKeyedEventSink
from scheduler.core.hybrid.hybrid_kv_cache_coordinator import HybridKVCacheCoordinator
from scheduler.core.hybrid.hybrid_tier_hit import find_tier_hit
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_blocks import KVCacheBlocks
from scheduler.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.kv_events import KVEventSink
from scheduler.core.offload.external_tier import ExternalOps, ExternalTier
from scheduler.core.offload.offload_tier import HostTier, HostTierCopies
from scheduler.core.offload.offloading_connector import OffloadingConnector
from scheduler.core.prefix_cache_stats import PrefixCacheStats
from scheduler.core.retention.pinned_blocks import PinnedBlocks

# (num_gpu_blocks, enable_caching, event_sink) -> the pool. BlockPool itself by
# default; what-if studies pass pools with other free-queue rules.
PoolFactory = Callable[[int, bool, "KVEventSink | None"], BlockPool]
# When blocks are copied to the host tier (--kv-offloading-store).
OFFLOAD_STORE_MODES = ("eviction", "full")


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, max_model_len: int, enable_caching: bool = True, event_sink: KVEventSink | None = None,
                 pool_factory: PoolFactory = BlockPool, host_tier: HostTier | None = None, offload_store: str = "eviction",
                 max_pinned_fraction: float = 0.5, external_tier: ExternalTier | None = None, *, group_windows: Sequence[int] = (),
                 max_num_batched_tokens: int | None = None, log_stats: bool = True):
        """``group_windows``: each KV-cache group's window (0: full attention), in group order;
        () or (0,): one full-attention group. ``max_num_batched_tokens`` caps a sliding group's
        admission blocks (None: max_model_len). ``log_stats`` (vLLM's): False leaves
        ``prefix_cache_stats`` None and counts nothing; the scheduler keeps it on, since
        /metrics reads the counters whatever --disable-log-stats says."""
        if offload_store not in OFFLOAD_STORE_MODES:
            raise ValueError(f"offload_store must be one of {OFFLOAD_STORE_MODES}, got {offload_store!r}")
        if host_tier is not None and host_tier.block_size != block_size:
            raise ValueError(f"the host tier's block size {host_tier.block_size} differs from the pool's {block_size}")
        if any(not isinstance(w, int) or w < 0 for w in group_windows):
            raise ValueError(f"group_windows: one window >= 0 per KV-cache group (0: full attention), got {list(group_windows)}")
        hybrid = is_hybrid(group_windows)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.group_windows = list(group_windows) if hybrid else [0]
        if hybrid and event_sink is not None:
            event_sink = GroupKeyedEventSink(event_sink, self.group_windows)
        if hybrid and host_tier is not None and host_tier.event_sink is not None and not isinstance(host_tier.event_sink, GroupKeyedEventSink):
            # The tier holds keyed hashes too: its CPU events name the hash and the group, as the pool's.
            host_tier.event_sink = GroupKeyedEventSink(host_tier.event_sink, self.group_windows)
        self.block_pool = pool_factory(num_gpu_blocks, enable_caching, event_sink)
        # The host tier (None: no offloading). Without caching nothing is hashed,
        # so nothing could be stored or found: the tier is left out.
        self.host_tier = host_tier if enable_caching else None
        self.offload_store = offload_store
        write_through = self.host_tier is not None and offload_store == "full"
        self.offloading_connector = None if self.host_tier is None else OffloadingConnector(self.host_tier, self.block_pool, write_through)
        # The external tier (disk, Mooncake Store: scheduler/core/offload/external_tier.py), below the host
        # tier; None without one (or without caching: nothing would be hashed).
        self.external = external_tier if enable_caching else None
        if hybrid:
            self.coordinator = HybridKVCacheCoordinator(self.block_pool, block_size, max_model_len, group_windows, enable_caching,
                                                        max_num_batched_tokens, self.offloading_connector, write_through, self.external)
        else:
            self.coordinator = UnitaryKVCacheCoordinator(self.block_pool, block_size, max_model_len, enable_caching,
                                                         self.offloading_connector, write_through, self.external)
        # Pinned prefixes (POST /v1/cache/pin): pool-level owners of their blocks, in every group.
        self.pinned = PinnedBlocks(self.block_pool, int(max_pinned_fraction * (num_gpu_blocks - 1)), self.coordinator)
        self.num_groups = self.coordinator.num_groups
        # request_id -> its table of group 0 (every group's tables hold the same requests).
        self.req_to_blocks = self.coordinator.req_to_blocks
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        # vLLM's connector_prefix_cache_stats: tokens asked of the host tier (what the device did
        # not hold) and found there (vllm:external_prefix_cache_*).
        self.external_prefix_cache_stats = PrefixCacheStats()
        # Whether a KV connector (P/D disaggregation: scheduler/sched/pd_connector.py) is a source
        # of tokens too: then, as vLLM, the connector's stats are kept even with no tier.
        self.has_connector = False
        # The decode call goes straight to the coordinator: nothing of the manager's is in it.
        self.allocate_next_slot = self.coordinator.allocate_next_slot

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def min_num_free_blocks(self) -> int:
        """Fewest free blocks seen right after an allocation: the peak of usage, which a poll
        between steps misses (frees come at the end of every step); read by kv_cache_usage.py."""
        return self.coordinator.min_num_free_blocks

    @min_num_free_blocks.setter
    def min_num_free_blocks(self, value: int) -> None:
        self.coordinator.min_num_free_blocks = value

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a new request of ``num_tokens`` tokens needs in every group together."""
        return self.coordinator.num_blocks_needed(num_tokens)

    def get_computed_blocks(self, request: KVCacheRequest, record_stats: bool = True) -> tuple[KVCacheBlocks, int]:
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
            if self.num_groups > 1:
                self.coordinator.set_shared_prefix_boundary(request.request_id, 0)
            return KVCacheBlocks(tuple([] for _ in range(self.num_groups))), 0
        hits, num_hit_tokens, num_host_hit_tokens = self.coordinator.find_longest_cache_hit(request)
        if record_stats:
            self.record_prefix_cache_query(request.num_tokens, num_hit_tokens, request.num_preemptions > 0, num_host_hit_tokens)
        return hits, num_hit_tokens

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
        if not self.enable_caching or self.prefix_cache_stats is None:
            return
        num_local = num_hit_tokens - num_host_hit_tokens
        self.prefix_cache_stats.record(num_tokens, num_local, preempted)
        if self.host_tier is not None or self.external is not None or self.has_connector:
            self.external_prefix_cache_stats.record(num_tokens - num_local, num_host_hit_tokens, preempted)

    def allocate_slots(self, request: KVCacheRequest, num_new_tokens: int, num_new_computed_tokens: int = 0, new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, full_sequence_must_fit: bool = False, watermark_blocks: int = 0,
                       delay_cache: bool = False) -> KVCacheBlocks | None:
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
        not yet written: their blocks are cached by `cache_loaded` once the load is in.

        ``allocate_next_slot(request)`` is ``allocate_slots(request, 1)`` for a running
        request (a decode step, or the last token of a chunked prompt), the coordinator's
        own: the same effect and result, without the general path's work."""
        return self.coordinator.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
                                               full_sequence_must_fit, watermark_blocks, delay_cache)

    def free(self, request: KVCacheRequest, num_computed_tokens: int | None = None) -> None:
        """Give back the request's blocks, each table last block first (its deepest are
        evicted first). ``num_computed_tokens``: a request preempted in the step that
        scheduled it; its blocks cached past that many tokens lose their hash (KV never written)."""
        self.coordinator.free(request, num_computed_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's table in every group (a sliding group's null entries are 0)."""
        return self.coordinator.get_block_ids(request_id)

    def take_nulled(self) -> Sequence[tuple[str, int, int]]:
        """(request_id, group, leading null entries) for every live request and sliding group
        whose leading null entries grew since the last call (none with one group)."""
        return self.coordinator.take_nulled()

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
        if end <= start:
            return 0
        if self.num_groups > 1:
            # Every group's blocks the hit needs, under their keyed hashes (hybrid_tier_hit.py).
            return (find_tier_hit(self.group_windows, request.block_hashes, start, end, self.block_size, self.external) - start) * self.block_size
        return self.external.lookup(request.block_hashes[start:end]) * self.block_size

    def cache_loaded(self, request: KVCacheRequest, num_computed_tokens: int) -> None:
        """An external load ended: the request's first ``num_computed_tokens`` tokens are in
        its blocks; cache (hash) those full blocks, as if just computed."""
        self.coordinator.cache_loaded(request, num_computed_tokens)

    def load_targets(self, request_id: str, first_block: int, num_blocks: int) -> list[tuple[int, int, KVCacheBlock]]:
        """(group, position, block) for the request's table entries at positions ``first_block``
        .. + ``num_blocks`` that a load from outside (the external tier, a prefill engine) writes:
        every group's, null entries left out; position by position, groups in order within one."""
        return self.coordinator.load_targets(request_id, first_block, num_blocks)

    def keyed_hash(self, block_hash: BlockHash, group: int) -> BlockHash:
        """The key a tier holds group ``group``'s block of ``block_hash`` under (one group: the hash)."""
        return self.coordinator.keyed_hash(block_hash, group)

    def take_external_ops(self) -> ExternalOps | None:
        """The step's external saves and loads for its plan (None: none, or no tier)."""
        return None if self.external is None else self.external.take_ops()

    def reset_prefix_cache(self) -> bool:
        """Drop every hash, on the device and in the host tier (vLLM's CPU tier
        keeps serving after a reset; here both go). Refused (False, nothing
        changed) while any request holds a block. Pins are released first (their
        blocks are the pool's own): ``self.pinned.num_cleared`` counts them."""
        if self.coordinator.has_requests():
            return False
        self.pinned.clear()
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.offloading_connector is not None:
            self.offloading_connector.clear()
        return True

    def check_invariants(self) -> None:
        """Pool invariants, plus: every held block's ref_cnt equals the number of
        tables and pins holding it (null entries own nothing); the coordinator's own
        (hybrid: tables equally long, null entries leading); the host tier's."""
        self.block_pool.check_invariants()
        if self.offloading_connector is not None:
            self.offloading_connector.check_invariants()
        owners: dict[int, int] = {}
        for blocks in [*self.coordinator.held_blocks(), self.pinned.blocks()]:
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            num_owners = owners.get(block.block_id, 0)
            assert block.ref_cnt == num_owners, f"block {block.block_id}: ref_cnt {block.ref_cnt}, in {num_owners} tables and pins"
