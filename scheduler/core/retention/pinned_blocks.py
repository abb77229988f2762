"""PinnedBlocks: prefixes kept in the device pool whatever the eviction policy
(POST /v1/cache/pin, a kvpool extension).

A pin is one more owner of a block (a pool-level reference, as a request's table
is one): a pinned block never enters the free queue, so no policy can evict it,
and KV events stay vLLM's (a pinned block is simply not removed). One pin per
block hash, whichever prompts asked for it: pinning a prompt again (or another
prompt sharing its prefix) extends the expiry, never the count; unpinning a
prompt releases every block of it that is pinned, deepest first.

Which pool blocks a prompt's hashes name is the coordinator's (`PinTargets`): with
one group, the block of each hash; with several (a hybrid model), each group's block
under its group-keyed hash -- every full-attention block of the prefix, and each
sliding-window group's cached blocks of it (such a group caches only the window tails
a later hit can resume at, so those are the ones a hit reads; lacking the tail the hit
at the prompt's length needs, it counts as missing). Pins are keyed by the pool's hash,
so everything here is the same for one group and many, and ``max_pinned_blocks``
counts pool blocks across groups.

Pins are all or nothing: a prompt is pinned only when every block a hit on it needs
is cached (the caller computes the missing ones first, then asks again), and refused
with nothing pinned when the pinned blocks would exceed ``max_pinned_blocks``. Expiry
(``ttl_s``) is checked by ``expire``, which the scheduler calls once a step:
O(expired) plus a heap pop each.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_block import BlockHash, KVCacheBlock


class PinRefused(ValueError):
    """Pinning would exceed the cap; nothing was pinned."""


@dataclass(frozen=True, slots=True)
class PinOutcome:
    # Blocks of the prompt (positions, whatever the number of groups) pinned (held by a
    # pin now) or, for unpin, released.
    num_blocks: int
    num_missing: int = 0  # pin: the prompt's blocks to compute first (then nothing was pinned)


class PinTargets(Protocol):
    """The coordinator's side of a pin: which pool blocks a prompt's hashes name."""

    def blocks_to_pin(self, block_hashes: Sequence[BlockHash],
                      num_tokens: int | None) -> tuple[list[tuple[BlockHash, KVCacheBlock]], int]:
        """((pool hash, block) for every block a pin of this prompt of ``num_tokens`` tokens
        (None: one more than its full blocks) holds, shallowest first; and 0), or
        ([], how many of the prompt's blocks to compute first)."""
        ...

    def pin_keys(self, block_hashes: Sequence[BlockHash]) -> list[tuple[BlockHash, ...]]:
        """Each prompt block's pool hashes, one per group."""
        ...


class PinnedBlocks:
    def __init__(self, pool: BlockPool, max_pinned_blocks: int, targets: PinTargets):
        self.pool = pool
        self.max_pinned_blocks = max_pinned_blocks
        self.targets = targets
        # pool hash -> (the block the pin holds, its expiry on the caller's clock; inf: none).
        self._pins: dict[BlockHash, tuple[KVCacheBlock, float]] = {}
        # (expiry, hash): may hold stale entries (unpinned, or extended), skipped on pop.
        self._expiries: list[tuple[float, BlockHash]] = []
        # Counters, read by the process loop.
        self.num_refusals = 0
        self.num_expired = 0
        self.num_cleared = 0

    @property
    def num_pinned_blocks(self) -> int:
        return len(self._pins)

    def pin(self, block_hashes: Sequence[BlockHash], now: float, ttl_s: float | None = None,
            num_tokens: int | None = None) -> PinOutcome:
        """Pin the blocks of ``block_hashes`` (a prompt's full blocks, in order; the prompt
        has ``num_tokens`` tokens, None: one more than its full blocks hold)."""
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s}")
        targets, num_missing = self.targets.blocks_to_pin(block_hashes, num_tokens)
        if num_missing:
            return PinOutcome(0, num_missing)
        pins = self._pins
        new = [b for h, b in targets if h not in pins]
        if len(pins) + len(new) > self.max_pinned_blocks:
            self.num_refusals += 1
            raise PinRefused(f"pinning {len(new)} more blocks would pin {len(pins) + len(new)} of the pool's "
                             f"{self.pool.num_gpu_blocks - 1}, over the cap of {self.max_pinned_blocks} (--max-pinned-fraction); "
                             f"{len(pins)} are pinned now")
        self._add_owner(new)
        expiry = math.inf if ttl_s is None else now + ttl_s
        for key, block in targets:
            held = pins.get(key)
            if held is None or held[1] < expiry:
                pins[key] = (held[0] if held is not None else block, expiry)
                if expiry != math.inf:
                    heapq.heappush(self._expiries, (expiry, key))
        return PinOutcome(len(block_hashes))

    def _add_owner(self, blocks: list[KVCacheBlock]) -> None:
        # NOTE: not pool.touch: a pin is no access, so the policies' hit counts
        # (lfu, arc, s3fifo) do not see it; a block pinned, then unpinned, is as
        # evictable as it was.
        pool = self.pool
        for block in blocks:
            if block.ref_cnt == 0:
                pool.free_block_queue.remove(block)
                pool.num_free_cached_blocks -= 1
            block.ref_cnt += 1

    def unpin(self, block_hashes: Sequence[BlockHash]) -> PinOutcome:
        """Release the pins of ``block_hashes`` that are pinned (deepest first), in every
        group; the outcome counts the prompt's blocks of which any group's was released."""
        pins, released, num_positions = self._pins, [], 0
        for keys in reversed(self.targets.pin_keys(block_hashes)):
            held = [pins.pop(k)[0] for k in reversed(keys) if k in pins]
            released += held
            num_positions += bool(held)
        self.pool.free_blocks(released)
        return PinOutcome(num_positions)

    def expire(self, now: float) -> int:
        """Release the pins whose expiry has come; how many."""
        heap, pins = self._expiries, self._pins
        released = []
        while heap and heap[0][0] <= now:
            expiry, block_hash = heapq.heappop(heap)
            held = pins.get(block_hash)
            if held is not None and held[1] == expiry:
                del pins[block_hash]
                released.append(held[0])
        if released:
            # NOTE: a prompt's blocks share an expiry and were pushed first to last:
            # the deepest go back first, as a request's do.
            released.reverse()
            self.pool.free_blocks(released)
            self.num_expired += len(released)
        return len(released)

    def clear(self) -> int:
        """Release every pin (a reset, a lost worker); how many."""
        released = [block for block, _ in self._pins.values()][::-1]
        self._pins.clear()
        self._expiries.clear()
        self.pool.free_blocks(released)
        self.num_cleared += len(released)
        return len(released)

    def blocks(self) -> list[KVCacheBlock]:
        return [block for block, _ in self._pins.values()]
