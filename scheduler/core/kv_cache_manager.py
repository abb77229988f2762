"""KVCacheManager: request block tables over the BlockPool (one attention group).

The scheduler asks three things of it: which prefix of a request is already cached
(`get_computed_blocks`), room for the tokens it is about to schedule
(`allocate_slots`), and to give a request's blocks back (`free`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_events import KVEventSink

# (num_gpu_blocks, enable_caching, event_sink) -> the pool. BlockPool itself by
# default; what-if studies pass pools with other free-queue rules.
PoolFactory = Callable[[int, bool, "KVEventSink | None"], BlockPool]


class Request(Protocol):
    """What the manager reads and writes of a request (``scheduler.sched.request``'s
    Request is one): the core does not depend on the policy's request type."""

    request_id: str
    num_computed_tokens: int
    block_hashes: Sequence[BlockHash]
    all_token_ids: Sequence[int]
    # Set here: the computed-token count below which another allocation would
    # allocate and cache nothing (the scheduler's decode fast path).
    kv_fast_until: int
    # Times preempted so far: a resumed request's lookups are counted apart.
    num_preemptions: int

    @property
    def num_tokens(self) -> int: ...


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens, as vLLM's PrefixCacheStats.

    ``requests/queries/hits`` count first admissions only (vllm:prefix_cache_queries
    and _hits); a request resumed after preemption is counted apart, in the
    ``preempted_*`` fields. NOTE: a victim re-admitted hits its own freed blocks,
    so counting it again would raise the hit rate exactly when the pool is too
    small."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """Of first admissions: hits / queries (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0

    @property
    def preempted_hit_rate(self) -> float:
        return self.preempted_hits / self.preempted_queries if self.preempted_queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        event_sink: KVEventSink | None = None,
        pool_factory: PoolFactory = BlockPool,
    ):
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = pool_factory(num_gpu_blocks, enable_caching, event_sink)
        # request_id -> its block table, in order (append-only while it runs).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> how many leading blocks of its table are cached (hashed).
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Fewest free blocks seen right after an allocation: the peak of usage, which
        # a poll between steps misses (frees come at the end of every step).
        self.min_num_free_blocks = self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def peak_usage(self) -> float:
        """The highest `usage` since start (vllm:kv_cache_usage_perc's peak)."""
        return 1.0 - self.min_num_free_blocks / (self.block_pool.num_gpu_blocks - 1)

    def get_num_held_tokens(self, requests: Iterable[Request]) -> int:
        """Token slots of the held blocks that hold a token (computed or scheduled),
        a shared block counted once. ``requests``: every request holding blocks.

        NOTE: a shared block is full (only full blocks are cached), so every empty
        slot is in the private tail of one request's table: held slots minus each
        request's empty tail."""
        block_size = self.block_size
        pool = self.block_pool
        num_used = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        num_empty = 0
        get = self.req_to_blocks.get
        for request in requests:
            blocks = get(request.request_id)
            if blocks:
                num_empty += max(0, len(blocks) * block_size - request.num_computed_tokens)
        return num_used * block_size - num_empty

    def get_token_usage(self, requests: Iterable[Request]) -> float:
        """Held tokens over the pool's token slots (null block left out): what
        `usage` says in blocks, in tokens (a block holding one token counts 1/block_size)."""
        return self.get_num_held_tokens(requests) / ((self.block_pool.num_gpu_blocks - 1) * self.block_size)

    def get_computed_blocks(self, request: Request, record_stats: bool = True) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in
        tokens. Capped so the last prompt token is always computed: the worker needs
        its logits to sample the first output token.

        ``record_stats=False`` lets a caller count the lookup only once it admits the
        request (`record_prefix_cache_query`), so a request that waits several steps
        for room is counted once."""
        if not self.enable_caching:
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
        num_computed_tokens = len(computed) * self.block_size
        if record_stats:
            self.record_prefix_cache_query(request.num_tokens, num_computed_tokens, request.num_preemptions > 0)
        return computed, num_computed_tokens

    def record_prefix_cache_query(self, num_tokens: int, num_hit_tokens: int, preempted: bool = False) -> None:
        """Count one admission's lookup; ``preempted``: the request is resumed after
        a preemption (vLLM: ``request.num_preemptions > 0``), counted apart."""
        if not self.enable_caching:
            return
        self.prefix_cache_stats.record(num_tokens, num_hit_tokens, preempted)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after its
        computed tokens and the ``new_computed_blocks`` prefix hits).

        Returns the newly allocated blocks (not the hits), or None — with nothing
        changed — when they do not fit. Then caches the request's full blocks up to
        min(computed + new, request.num_tokens): only final tokens are hashed.
        """
        if num_new_tokens < 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("token counts must be >= 0")
        if new_computed_blocks is None:
            new_computed_blocks = ()
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        num_held = len(req_blocks) if req_blocks is not None else 0
        if new_computed_blocks and num_held:
            raise ValueError(f"request {request_id!r} already holds blocks; prefix hits only at admission")
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_new_blocks = -(-num_tokens_need_slot // self.block_size) - num_held - len(new_computed_blocks)

        # NOTE: a hit on a free block takes it out of the free queue, so those hits
        # are not free for this request's new blocks.
        pool = self.block_pool
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null) if new_computed_blocks else 0
        if num_new_blocks > pool.free_block_queue.num_free_blocks - num_evictable_hits:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_block[request_id] = 0
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            # Hits are cached already.
            self.num_cached_block[request_id] = len(req_blocks)
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
        else:
            new_blocks = []
        if pool.free_block_queue.num_free_blocks < self.min_num_free_blocks:
            self.min_num_free_blocks = pool.free_block_queue.num_free_blocks

        self._cache_and_bound(request, req_blocks, min(num_computed_tokens + num_new_tokens, len(request.all_token_ids)))
        return new_blocks

    def allocate_next_slot(self, request: Request) -> list[KVCacheBlock] | None:
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
            if pool.free_block_queue.num_free_blocks < self.min_num_free_blocks:
                self.min_num_free_blocks = pool.free_block_queue.num_free_blocks
        else:
            new_blocks = []
        self._cache_and_bound(request, req_blocks, min(end, len(request.all_token_ids)))
        return new_blocks

    def _cache_and_bound(self, request: Request, req_blocks: list[KVCacheBlock], num_final_tokens: int) -> None:
        """Cache (hash and register) the request's full blocks within its first
        ``num_final_tokens`` tokens (final, and computed or scheduled), and set
        request.kv_fast_until."""
        block_size = self.block_size
        if not self.enable_caching:
            request.kv_fast_until = len(req_blocks) * block_size
            return
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full_blocks = num_final_tokens // block_size
        if num_full_blocks > num_cached:
            self.block_pool.cache_full_blocks(
                req_blocks, request.block_hashes, num_cached, num_full_blocks, request.all_token_ids, block_size
            )
            self.num_cached_block[request_id] = num_cached = num_full_blocks
        # While its computed tokens stay at or below this, a call for this request
        # would allocate nothing (its blocks have room) and cache nothing (no block
        # past the cached ones fills): the scheduler skips the call (fast path).
        request.kv_fast_until = min(len(req_blocks) * block_size, (num_cached + 1) * block_size - 1)

    def free(self, request: Request) -> None:
        """Give back the request's blocks, last block first, so that its deepest
        blocks are evicted before its first ones."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        request.kv_fast_until = 0
        if blocks:
            blocks.reverse()
            self.block_pool.free_blocks(blocks)

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Pool invariants, plus: every held block's ref_cnt equals the number of
        tables holding it."""
        self.block_pool.check_invariants()
        owners: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            assert block.ref_cnt == owners.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, in {owners.get(block.block_id, 0)} tables"
            )
