"""SimulatedStore: what the simulated external tier (a disk directory, a Mooncake Store) holds.

The simulator's stand-in for the worker's store (worker/external/disk_store.py): key ->
bytes, least recently used first, bounded in blocks (0: unbounded). As the disk store
does, a save past the bound removes the least recently used objects and says which (the
scheduler's index is told, as the worker reports them), and a read counts as a use. It
is the one source of truth: the scheduler's `KnownKeys` only learns from it.

It outlives a run: a warm start (``--external-tier-warm``) replays the workload into it
once, then measures a second replay that finds what the first one left.
"""

from __future__ import annotations

from collections import OrderedDict


class SimulatedStore:
    def __init__(self, max_blocks: int = 0):
        if max_blocks < 0:
            raise ValueError(f"the external tier's capacity must be >= 0 blocks (0: unbounded), got {max_blocks}")
        self.max_blocks = max_blocks
        # key -> bytes, least recently used first.
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.num_evictions = 0

    def put(self, key: str, size: int) -> list[str]:
        """Hold ``key`` (most recently used); returns the keys removed to make room."""
        sizes = self._sizes
        sizes[key] = size
        sizes.move_to_end(key)
        if not self.max_blocks or len(sizes) <= self.max_blocks:
            return []
        removed = []
        while len(sizes) > self.max_blocks:
            removed.append(sizes.popitem(last=False)[0])
        self.num_evictions += len(removed)
        return removed

    def get(self, key: str) -> int | None:
        """The bytes of ``key`` (now the most recently used), None when it is not held."""
        size = self._sizes.get(key)
        if size is not None:
            self._sizes.move_to_end(key)
        return size

    def remove(self, key: str) -> None:
        """Drop ``key`` if held (a failed load's later blocks: they are computed and saved again)."""
        self._sizes.pop(key, None)

    def keys(self) -> list[str]:
        """Every key held, least recently used first (a worker's hello lists these)."""
        return list(self._sizes)

    def __len__(self) -> int:
        return len(self._sizes)
