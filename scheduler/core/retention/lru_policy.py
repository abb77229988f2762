"""LRUPolicy: which host-tier entry is evicted next (least recently used first).

The host tier (`scheduler/core/offload/offload_tier.py`) keeps every entry itself; a policy
only orders the entries that may be evicted now: stored (the copy has run) and
not pinned by a load in flight. The tier tells it when an entry becomes
evictable (`insert`, at the most recently used end), when it stops being so
(`remove`: a load pins it, or the tier drops it) and asks it for a victim
(`evict`). Another policy (ARC, ...) implements the same five methods.

One dict, in insertion order: O(1) for every operation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from scheduler.core.kv_cache_block import BlockHash


class EvictionPolicy(Protocol):
    """What the host tier asks of its eviction policy."""

    def insert(self, block_hash: BlockHash) -> None: ...

    def remove(self, block_hash: BlockHash) -> None: ...

    def evict(self) -> BlockHash | None: ...

    def clear(self) -> None: ...

    def __len__(self) -> int: ...

    def __contains__(self, block_hash: object) -> bool: ...


class LRUPolicy:
    __slots__ = ("_order",)

    def __init__(self) -> None:
        # The evictable hashes, least recently used first (dict order).
        self._order: dict[BlockHash, None] = {}

    def insert(self, block_hash: BlockHash) -> None:
        """``block_hash`` became evictable, as the most recently used entry."""
        if block_hash in self._order:
            raise ValueError(f"hash {block_hash.hex()[:16]} is already evictable")
        self._order[block_hash] = None

    def remove(self, block_hash: BlockHash) -> None:
        """``block_hash`` is no longer evictable (pinned, or dropped by the tier)."""
        try:
            del self._order[block_hash]
        except KeyError:
            raise ValueError(f"hash {block_hash.hex()[:16]} is not evictable") from None

    def evict(self) -> BlockHash | None:
        """Take the least recently used evictable hash; None when there is none."""
        order = self._order
        if not order:
            return None
        block_hash = next(iter(order))
        del order[block_hash]
        return block_hash

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._order

    def __iter__(self) -> Iterator[BlockHash]:
        """Least recently used first (the eviction order)."""
        return iter(self._order)
