"""Pins (POST /v1/cache/pin) with hybrid KV-cache groups: refused.

A pin holds a prompt's blocks in the pool; with sliding-window groups a prompt's
cached state is one block run per group, not a prefix of one table, and kvpool
does not pin those. `HybridPins` answers as `PinnedBlocks` does with nothing pinned,
and refuses every pin with a reason the HTTP route returns as a 400."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock
from scheduler.core.retention.pinned_blocks import PinOutcome, PinRefused

REASON = "pins are not supported with hybrid KV-cache groups (a model with sliding-window layers)"


class HybridPins:
    num_pinned_blocks = 0
    num_expired = 0
    num_cleared = 0

    def __init__(self) -> None:
        self.num_refusals = 0

    def pin(
        self, block_hashes: Sequence[BlockHash], now: float, ttl_s: float | None = None
    ) -> PinOutcome:
        self.num_refusals += 1
        raise PinRefused(REASON)

    def unpin(self, block_hashes: Sequence[BlockHash]) -> PinOutcome:
        return PinOutcome(0)

    def expire(self, now: float) -> int:
        return 0

    def clear(self) -> int:
        return 0

    def blocks(self) -> list[KVCacheBlock]:
        return []
