"""Where the pool reports prefix-cache changes, for KV events (routers) and tests.

The pool calls a sink only when caching changes what a router could hit:
a hash newly stored, the last block holding a hash losing it, or a reset.
`KVEventRecorder` keeps them in order until the step loop takes them.

Each stored/removed event names its medium, as vLLM's do: "GPU" for the device
pool, "CPU" for the host tier (scheduler/core/offload/offload_tier.py), whose events are
vLLM's offloading connector's: no parent hash, no tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from protocol.kv_events import MEDIUM_GPU
from scheduler.core.kv_cache_block import BlockHash


class KVEventSink(Protocol):
    def block_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: list[int] | None,
        block_size: int,
        medium: str = MEDIUM_GPU,
        *,
        group_idx: int = 0,
        sliding_window: int = 0,
    ) -> None: ...

    def block_removed(self, block_hash: BlockHash, medium: str = MEDIUM_GPU, *, group_idx: int = 0) -> None: ...

    def all_blocks_cleared(self) -> None: ...


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int] | None
    block_size: int
    medium: str = MEDIUM_GPU
    # The KV-cache group (hybrid models; scheduler/core/hybrid/group_events.py) and its window (0: full attention).
    group_idx: int = 0
    sliding_window: int = 0


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str = MEDIUM_GPU
    group_idx: int = 0


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventRecorder:
    """A KVEventSink that keeps events in order until `take_events()` (vLLM's name)."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def block_stored(self, block_hashes, parent_block_hash, token_ids, block_size, medium: str = MEDIUM_GPU, *, group_idx: int = 0,
                     sliding_window: int = 0) -> None:
        self.events.append(BlockStored(list(block_hashes), parent_block_hash, token_ids, block_size, medium, group_idx, sliding_window))

    def block_removed(self, block_hash: BlockHash, medium: str = MEDIUM_GPU, *, group_idx: int = 0) -> None:
        self.events.append(BlockRemoved([block_hash], medium, group_idx))

    def all_blocks_cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
