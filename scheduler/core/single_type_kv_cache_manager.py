"""The block tables of one KV-cache group: vLLM 0.32's SingleTypeKVCacheManager,
for full attention and for a sliding window (``single_type_kv_cache_manager.py``).

Every group shares the one BlockPool. A group's cached blocks are keyed by
(hash, group), vLLM's ``BlockHashWithGroupId``: the request's hash with the group id
appended as 4 big-endian bytes (`group_key`), so the pool needs no change: it is
handed keyed hashes (`KeyedHashes`) and keys its map, events and evictions by them.

A sliding-window group of window W frees, as the request advances, every block
wholly before the window of the next token (positions <= computed - W) and puts
the null block in its place: the table keeps its length, its leading entries null.
vLLM's rules kept exactly (eagle, DCP, positive retention intervals and fine-grained
hashes left out: one block size, no spec decode). A sliding group caches only the
blocks vLLM serve's default retention (0) keeps: sliding_window_retention.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.block_pool import BlockPool
from scheduler.core.hybrid.sliding_window_retention import retained_block_runs
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_request import KVCacheRequest


def group_key(group_id: int) -> bytes:
    """The suffix that makes a hash a (hash, group) key (vLLM's make_block_hash_with_group_id)."""
    return group_id.to_bytes(4, "big")


class KeyedHashes(Sequence):
    """A request's block hashes keyed by one group, made on access (no list kept)."""

    __slots__ = ("hashes", "suffix")

    def __init__(self, hashes: Sequence[BlockHash], suffix: bytes):
        self.hashes = hashes
        self.suffix = suffix

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [h + self.suffix for h in self.hashes[i]]
        return self.hashes[i] + self.suffix

    def __len__(self) -> int:
        return len(self.hashes)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What a group's manager reads of vLLM's KVCacheSpec (FullAttentionSpec,
    SlidingWindowSpec): tokens per block, and the window (0: full attention)."""

    block_size: int
    sliding_window: int = 0


class SingleTypeKVCacheManager:
    """Full attention: every block kept until the request is freed."""

    sliding_window = 0

    def __init__(self, kv_cache_spec: AttentionSpec, block_pool: BlockPool, enable_caching: bool, kv_cache_group_id: int):
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.block_size = kv_cache_spec.block_size
        self.group_id = kv_cache_group_id
        self.suffix = group_key(kv_cache_group_id)
        self.enable_caching = enable_caching
        self.null_block = block_pool.null_block
        # request_id -> its table in this group (append-only but for leading nulls).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request_id -> leading blocks of its table already cached (null entries included).
        self.num_cached_block: dict[str, int] = {}

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token (none for full attention)."""
        return 0

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, max_admission_blocks: int | None = None) -> int:
        """Blocks the pool must give for ``num_tokens`` slots: new ones, and the hits
        that are free now (a hit takes its block out of the free queue).
        ``max_admission_blocks``: vLLM's recycling-aware cap (admission check only)."""
        num_required_blocks = cdiv(num_tokens, self.block_size)
        if max_admission_blocks is not None:
            num_required_blocks = min(num_required_blocks, max_admission_blocks)
        req_blocks = self.req_to_blocks.get(request_id, ())
        num_req_blocks = len(req_blocks)
        if request_id in self.num_cached_block:
            # A running request: no new prefix hits.
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(
            num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0
        )
        # NOTE: hits wholly before the window are never touched, so their blocks stay free.
        num_skipped_hits = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable = sum(
            1 for b in new_computed_blocks[num_skipped_hits:] if b.ref_cnt == 0 and not b.is_null
        )
        return num_new_blocks + num_evictable

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        """A new request's prefix hits become its table; those wholly before the window
        are the null block (and are not touched)."""
        num_skipped_blocks = self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        req_blocks.extend([self.null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """New blocks for the table to hold ``num_tokens`` tokens; returns them."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int, reachable_boundaries: Sequence[int] = ()) -> list[tuple[int, int]]:
        """Cache the table's full blocks within the first ``num_tokens`` tokens (null entries
        skipped); returns the runs [lo, hi) cached. ``reachable_boundaries``: sliding windows'."""
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return []
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[request_id], KeyedHashes(request.block_hashes, self.suffix), num_cached_blocks,
            num_full_blocks, request.all_token_ids, self.block_size,
        )
        self.num_cached_block[request_id] = num_full_blocks
        return [(num_cached_blocks, num_full_blocks)]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Free the blocks wholly before the window of token ``num_computed_tokens``, deepest
        first (vLLM's order), and null their entries. Returns the leading null entries now."""
        return 0

    def num_null_blocks(self, request_id: str) -> int:
        """Leading null entries of the request's table (blocks freed before the window)."""
        return 0

    def free(self, request_id: str) -> None:
        """Give back the request's blocks, last first (its deepest are evicted first)."""
        self.num_cached_block.pop(request_id, None)
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int, group_ids: list[int], block_pool: BlockPool,
                               block_size: int, sliding_window: int) -> tuple[list[list[KVCacheBlock]], int]:
        """Full attention: the longest run of cached blocks from the start, in every
        group of ``group_ids`` (groups of one spec are looked up together)."""
        get_one_block = block_pool.cached_block_hash_to_block.get_one_block
        suffixes = [group_key(g) for g in group_ids]
        computed: list[list[KVCacheBlock]] = [[] for _ in group_ids]
        for block_hash in block_hashes[: max_length // block_size]:
            found = [get_one_block(block_hash + s) for s in suffixes]
            if None in found:
                break
            for blocks, block in zip(computed, found, strict=True):
                blocks.append(block)
        return computed, len(computed[0]) * block_size


FullAttentionManager = SingleTypeKVCacheManager


class SlidingWindowManager(SingleTypeKVCacheManager):
    """A sliding window of ``sliding_window`` tokens (the token itself included)."""

    def __init__(self, kv_cache_spec: AttentionSpec, block_pool: BlockPool, enable_caching: bool, kv_cache_group_id: int):
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
        sliding_window = kv_cache_spec.sliding_window
        block_size = self.block_size
        if sliding_window < 1:
            raise ValueError(f"a sliding window is at least 1 token, got {sliding_window}")
        self.sliding_window = sliding_window
        # The blocks a hit needs: those holding the window of the token after it.
        self.num_tail_blocks = cdiv(sliding_window - 1, block_size)
        # request_id -> leading null entries of its table (the rest holds no null).
        self.num_null: dict[str, int] = {}

    def num_null_blocks(self, request_id: str) -> int:
        return self.num_null.get(request_id, 0)

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_computed_tokens: int
    ) -> None:
        super().add_local_computed_blocks(request_id, new_computed_blocks, num_computed_tokens)
        self.num_null[request_id] = (
            self.get_num_skipped_tokens(num_computed_tokens) // self.block_size
        )

    def free(self, request_id: str) -> None:
        self.num_null.pop(request_id, None)
        super().free(request_id)

    def cache_blocks(self, request: KVCacheRequest, num_tokens: int, reachable_boundaries: Sequence[int] = ()) -> list[tuple[int, int]]:
        """Cache only the full blocks within the first ``num_tokens`` tokens that end a
        hit at a reachable boundary (sliding_window_retention.py), returning their runs;
        the others stay unhashed for good (the table's cached count passes them)."""
        request_id = request.request_id
        num_cached_blocks = self.num_cached_block.get(request_id, 0)
        num_full_blocks = num_tokens // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return []
        # NOTE: a window of one token needs no block for a hit: none is cached (none
        # could serve a hit; vLLM's mask is empty too).
        runs = retained_block_runs(num_cached_blocks, num_full_blocks, self.num_tail_blocks,
                                   reachable_boundaries, self.block_size)
        if runs:
            blocks = self.req_to_blocks[request_id]
            hashes = KeyedHashes(request.block_hashes, self.suffix)
            for lo, hi in runs:
                self.block_pool.cache_full_blocks(
                    blocks, hashes, lo, hi, request.all_token_ids, self.block_size
                )
        self.num_cached_block[request_id] = num_full_blocks
        return runs

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next token (position num_computed_tokens) attends to (p - W, p].
        return max(0, num_computed_tokens - self.sliding_window + 1)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return 0
        num_skipped_blocks = min(
            self.get_num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks)
        )
        null = self.null_block
        freed: list[KVCacheBlock] = []
        # NOTE: backward from the last skipped block, up to the first null (the leading
        # entries already nulled): vLLM's order, which is the free queue's.
        for i in range(num_skipped_blocks - 1, -1, -1):
            if blocks[i] is null:
                break
            freed.append(blocks[i])
            blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)
        num_null = self.num_null.get(request_id, 0)
        if num_skipped_blocks > num_null:
            self.num_null[request_id] = num_null = num_skipped_blocks
        return num_null

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[BlockHash], max_length: int, group_ids: list[int], block_pool: BlockPool,
                               block_size: int, sliding_window: int) -> tuple[list[list[KVCacheBlock]], int]:
        """Sliding window: searched right to left for cdiv(W - 1, block_size) contiguous
        cached blocks (all the next token needs); the blocks before them are the null
        block. A run that reaches the first block is a hit however short."""
        get_one_block = block_pool.cached_block_hash_to_block.get_one_block
        suffixes = [group_key(g) for g in group_ids]
        num_contiguous_needed = cdiv(sliding_window - 1, block_size)
        max_num_blocks = max_length // block_size
        null = block_pool.null_block
        computed = [[null] * max_num_blocks for _ in group_ids]
        num_contiguous = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            found = [get_one_block(block_hashes[i] + s) for s in suffixes]
            if None in found:
                num_contiguous = 0
                continue
            for blocks, block in zip(computed, found, strict=True):
                blocks[i] = block
            num_contiguous += 1
            if num_contiguous >= num_contiguous_needed:
                for blocks in computed:
                    del blocks[i + num_contiguous :]
                match_found = True
                break
        if not match_found:
            for blocks in computed:
                del blocks[num_contiguous:]
        return computed, len(computed[0]) * block_size
