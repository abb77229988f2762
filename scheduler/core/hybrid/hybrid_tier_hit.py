"""Hits in a tier below the device (the host tier, the external tier) for a model of several
KV-cache groups: as vLLM's connectors, a second source of computed tokens after the device's.

The device's hit ends at block ``start`` (`HybridCacheHit`). A tier extends it to the
largest ``end`` (at most the cap) such that every full-attention group's block at each
position of [start, end) is in the tier, and every sliding-window group's blocks at the
positions of [start, end) that the window of the token at ``end * block_size`` reaches
(what computing that token reads; the positions before are null entries). Each group's
block is held under its group-keyed hash (``hash + group_key(g)``), as the pool keys it,
so a tier needs no notion of groups.

NOTE: the sliding condition is not monotone in ``end``: a longer hit needs later blocks
of a sliding group and frees it from earlier ones, so the search runs down from the full
groups' longest run instead of stopping at the first miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.kv_cache_request import KVCacheRequest
from scheduler.core.single_type_kv_cache_manager import group_key


class TierIndex(Protocol):
    """What the search asks of a tier (the host tier's connector, the external tier), keyed
    hashes in. NOTE: the groups know no tier (tests/test_layout.py): only these interfaces."""

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of ``block_hashes``, from the first, the tier holds."""
        ...

    def held(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """For each hash, whether the tier holds it."""
        ...


class TierSaves(Protocol):
    """A tier that stores the blocks a step caches (write-through, external saves)."""

    def add_written(self, req_blocks: list[KVCacheBlock], block_hashes: Sequence[BlockHash], start: int, end: int) -> None: ...

    def forget_written(self, blocks: Sequence[KVCacheBlock]) -> None: ...


class HostTierSide(TierIndex, TierSaves, Protocol):
    """The host tier as the coordinator drives it (`OffloadingConnector`)."""

    def pin_hits(self, block_hashes: Sequence[BlockHash]) -> list[object]: ...

    def add_loads(self, entries: Sequence[object], new_blocks: Sequence[KVCacheBlock]) -> None: ...

    def store_evicted(self) -> None: ...


def first_needed_block(window: int, num_tokens: int, block_size: int) -> int:
    """The first block position the token at ``num_tokens`` reads in a group of ``window``
    (0: full attention, every block); the entries before it are null
    (`SlidingWindowManager.get_num_skipped_tokens`)."""
    return max(0, num_tokens - window + 1) // block_size if window else 0


def find_tier_hit(windows: Sequence[int], block_hashes: Sequence[BlockHash], start: int, max_blocks: int,
                  block_size: int, tier: TierIndex) -> int:
    """The end (in blocks) of the longest hit the tier extends the device's, ending at block
    ``start``, to; at most ``max_blocks``; ``start`` when it extends nothing. ``windows``:
    each group's window (0: full attention), in group order."""
    end = max_blocks
    for g, window in enumerate(windows):
        if window == 0 and end > start:
            suffix = group_key(g)
            end = start + tier.lookup([h + suffix for h in block_hashes[start:end]])
    if end <= start:
        return start
    # Per sliding group: for each position i of [start, end), the last position <= i the
    # tier lacks (start - 1: none), so a hit at n needs only last[n - 1] < its first needed block.
    last_missing: list[tuple[int, list[int]]] = []
    for g, window in enumerate(windows):
        if window:
            suffix = group_key(g)
            last, lasts = start - 1, []
            for i, held in enumerate(tier.held([h + suffix for h in block_hashes[start:end]]), start):
                if not held:
                    last = i
                lasts.append(last)
            last_missing.append((window, lasts))
    for n in range(end, start, -1):
        if all(lasts[n - 1 - start] < max(start, first_needed_block(w, n * block_size, block_size)) for w, lasts in last_missing):
            return n
    return start


def tier_load_keys(windows: Sequence[int], block_hashes: Sequence[BlockHash], start: int, end: int,
                   num_computed_tokens: int, block_size: int) -> list[BlockHash]:
    """The keyed hashes a tier hit of blocks [start, end) loads once the request has
    ``num_computed_tokens`` (its table's null entries are the window's skipped ones): position
    by position, groups in order within one, as `HybridKVCacheCoordinator.load_targets`
    names their blocks."""
    firsts = [first_needed_block(w, num_computed_tokens, block_size) for w in windows]
    suffixes = [group_key(g) for g in range(len(windows))]
    return [block_hashes[i] + suffix for i in range(start, end)
            for first, suffix in zip(firsts, suffixes, strict=True) if i >= first]


class HybridTiers:
    """The host tier (``connector``; stores on eviction, or write-through when ``write_through``)
    and the external tier (``external``) under a hybrid coordinator's groups of ``windows``;
    either may be None."""

    def __init__(self, windows: Sequence[int], block_size: int, connector: HostTierSide | None,
                 write_through: bool, external: TierSaves | None):
        self.windows = list(windows)
        self.block_size = block_size
        self.connector = connector
        self.write_through = write_through
        self.external = external
        # Whether a block the coordinator caches goes to a tier (write-through, external saves).
        self.saves = write_through or external is not None

    def host_hit(self, block_hashes: Sequence[BlockHash], start: int, max_blocks: int) -> int:
        """`find_tier_hit` in the host tier (``start`` without one)."""
        if self.connector is None or start >= max_blocks:
            return start
        return find_tier_hit(self.windows, block_hashes, start, max_blocks, self.block_size, self.connector)

    def host_load_keys(self, request: KVCacheRequest, held: bool, num_new_computed_tokens: int, start: int,
                       num_window_tokens: int) -> list[BlockHash]:
        """The keyed hashes an admission's host hits (its computed tokens past its ``start``
        device hit blocks) load, or ValueError if they are not what the lookup found."""
        request_id, bs = request.request_id, self.block_size
        if self.connector is None:
            raise ValueError(f"request {request_id!r}: computed tokens beyond its device hits, but there is no host tier")
        if held or request.num_computed_tokens:
            raise ValueError(f"request {request_id!r} already holds blocks; prefix hits only at admission")
        if num_new_computed_tokens % bs:
            raise ValueError(f"num_new_computed_tokens {num_new_computed_tokens} is not a multiple of the block size {bs}")
        end = num_new_computed_tokens // bs
        keys = tier_load_keys(self.windows, request.block_hashes, start, min(end, len(request.block_hashes)), num_window_tokens, bs)
        if end > len(request.block_hashes) or not all(self.connector.held(keys)):
            raise ValueError(f"request {request_id!r}: {end - start} host-tier hit blocks claimed, the tier holds fewer")
        return keys

    def store_evicted(self) -> None:
        """Eviction mode: the hashes that just left their last device block go to the host tier."""
        self.connector.store_evicted()

    def add_written(self, blocks: list[KVCacheBlock], keyed_hashes: Sequence[BlockHash],
                    runs: Sequence[tuple[int, int]]) -> None:
        """A group's blocks in ``runs`` ([lo, hi) positions) were just cached: write-through
        stores and external saves, each under its keyed hash; null entries never."""
        positions = [i for lo, hi in runs for i in range(lo, hi) if not blocks[i].is_null]
        written = [blocks[i] for i in positions]
        hashes = [keyed_hashes[i] for i in positions]
        if self.write_through:
            self.connector.add_written(written, hashes, 0, len(written))
        if self.external is not None:
            self.external.add_written(written, hashes, 0, len(written))

    def forget_written(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Blocks cached by the step being planned that it will not compute after all."""
        if self.write_through:
            self.connector.forget_written(blocks)
        if self.external is not None:
            self.external.forget_written(blocks)
