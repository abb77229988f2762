"""Prefix hits across KV-cache groups: vLLM 0.32's HybridKVCacheCoordinator.find_longest_cache_hit.

Groups of one spec (the same window) are looked up together: a block position hits only
if every one of them holds the hash (vLLM's ``SpecGroup``). Full attention goes first:
its hits are a prefix, found left to right, once. Then each sliding window's group,
right to left within the candidate length. Any that shortens it sends every type round
again, until none does (the fixed point); with exactly full + one window, one round
(vLLM's ``is_simple_hybrid``). Full attention's blocks are then cut to the length.

It also answers vLLM's ``num_uncached_common_prefix_tokens``: how much longer the
longest single lookup was than the hit (a prefix full attention has cached but a
sliding group has not, under sparse retention); `get_computed_blocks` makes the
request's shared-prefix junction of it.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_blocks import KVCacheBlocks
from scheduler.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, cdiv, group_key


class HybridCacheHit:
    def __init__(
        self, managers: Sequence[SingleTypeKVCacheManager], block_pool: BlockPool, block_size: int
    ):
        self.managers = managers
        self.block_pool = block_pool
        self.block_size = block_size
        # (window, group ids) per spec, full attention first (vLLM's attention_groups).
        specs: dict[int, list[int]] = {}
        for m in managers:
            specs.setdefault(m.sliding_window, []).append(m.group_id)
        self.attention_groups = sorted(specs.items(), key=lambda item: item[0] != 0)
        self.simple_hybrid = len(self.attention_groups) == 2 and self.attention_groups[0][0] == 0

    def find(
        self, block_hashes: Sequence[BlockHash], max_length: int
    ) -> tuple[KVCacheBlocks, int, int]:
        """(hit blocks per group, hit length, uncached common prefix length)."""
        bs, pool, managers = self.block_size, self.block_pool, self.managers
        hit_blocks: list[list[KVCacheBlock] | None] = [None] * len(managers)
        full_hit_length = None
        hit_length = max_length
        longest_hit_length = 0
        while True:
            curr = hit_length
            for window, group_ids in self.attention_groups:
                if window == 0 and full_hit_length is not None:
                    curr = min(curr, full_hit_length)
                    continue
                lookup = type(managers[group_ids[0]]).find_longest_cache_hit
                blocks, curr = lookup(block_hashes, curr, group_ids, pool, bs, window)
                if window == 0:
                    full_hit_length = curr
                longest_hit_length = max(longest_hit_length, curr)
                for g, group_blocks in zip(group_ids, blocks, strict=True):
                    hit_blocks[g] = group_blocks
            if curr >= hit_length:
                break
            hit_length = curr
            if self.simple_hybrid:
                break
        num_blocks = cdiv(hit_length, bs)
        for window, group_ids in self.attention_groups:
            if window == 0:
                for g in group_ids:
                    del hit_blocks[g][num_blocks:]
        blocks = KVCacheBlocks(tuple(b if b is not None else [] for b in hit_blocks))
        return blocks, hit_length, longest_hit_length - hit_length

    # --- pins (scheduler/core/retention/pinned_blocks.py's PinTargets) ----------------

    def blocks_to_pin(self, block_hashes: Sequence[BlockHash],
                      num_tokens: int | None) -> tuple[list[tuple[BlockHash, KVCacheBlock]], int]:
        """A pin's blocks, group by group under each group's key: in a full-attention group
        every block of the prefix (else ([], how many from the first uncached)); in a
        sliding-window group its cached blocks of the prefix. NOTE: a sliding group caches
        only the window tails a later request can resume at (sliding_window_retention.py),
        so its cached blocks of the prefix are the ones a hit on it reads; holding them all
        keeps the hit at any boundary the prompt was served at, not only its own. Missing
        too when the hit at the prompt's replay length (``num_tokens - 1``, floored to a
        block; None: the whole prefix) falls short: a sliding group lost the tail it needs."""
        bs, get, n = self.block_size, self.block_pool.get_cached_block, len(block_hashes)
        targets = []
        for m in self.managers:
            suffix = group_key(m.group_id)
            for i, block_hash in enumerate(block_hashes):
                block = get(block_hash + suffix)
                if block is not None:
                    targets.append((block_hash + suffix, block))
                elif not m.sliding_window:
                    return [], n - i
        max_length = n * bs if num_tokens is None else max(0, min(num_tokens - 1, n * bs))
        hit_length = self.find(block_hashes, max_length)[1]
        if hit_length // bs < max_length // bs:
            return [], n - hit_length // bs
        return targets, 0

    def pin_keys(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, ...]]:
        suffixes = [group_key(m.group_id) for m in self.managers]
        return [tuple(h + s for s in suffixes) for h in block_hashes]
