"""KV residency: how long blocks live, idle before eviction, and wait between reuses.

vLLM's ``--kv-cache-metrics`` (`vllm/v1/core/kv_cache_metrics.py`), same
semantics: a sampled block's clock starts when it is allocated; each hit (`touch`)
is an access; when a block is handed out again with caching on, the previous
tenancy ends ("evicted") and yields

* lifetime: allocation to eviction (vllm:kv_block_lifetime_seconds),
* idle before evict: last access (allocation or hit) to eviction
  (vllm:kv_block_idle_before_evict_seconds),
* reuse gaps: between consecutive hits, the last `MAX_ACCESS_HISTORY` of them
  (vllm:kv_block_reuse_gap_seconds).

vLLM samples 1 % of blocks by default (a lock, a dict and a deque per block).
Here the state is three flat lists indexed by block id, the clock is read once per
call, and the observations wait in plain lists until the process loop takes them
(`take_residency`) once a step: cheap enough to watch every block (bench/pool_bench.py
measures the pool's calls, bench/scheduler_bench.py a 256-decode step, each beside the
plain pool). With the metrics off the engine builds a plain `BlockPool`: the hot
paths carry no hook at all.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.kv_events import KVEventSink

# vLLM's (vllm/v1/metrics/loggers.py, "KV Cache residency metrics"), in seconds.
RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
)
# Accesses remembered per block (vLLM's deque(maxlen=4)).
MAX_ACCESS_HISTORY = 4


@dataclass(slots=True)
class ResidencySamples:
    """Observations since the last take, in seconds."""

    lifetimes: list[float] = field(default_factory=list)
    idle_before_evict: list[float] = field(default_factory=list)
    reuse_gaps: list[float] = field(default_factory=list)


class ResidencyBlockPool(BlockPool):
    """A BlockPool that records the residency of its blocks (``sample_rate`` of
    their allocations, all by default)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool = True,
        event_sink: KVEventSink | None = None,
        *,
        sample_rate: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ):
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        super().__init__(num_gpu_blocks, enable_caching, event_sink)
        self.sample_rate = sample_rate
        self._clock = clock
        self._rng = rng
        # block id -> allocation time of a tracked block, None when untracked.
        self._born: list[float | None] = [None] * num_gpu_blocks
        self._last_access = [0.0] * num_gpu_blocks
        # block id -> times of its last hits (None: no hit yet).
        self._hits: list[deque[float] | None] = [None] * num_gpu_blocks
        self._samples = ResidencySamples()

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        blocks = BlockPool.get_new_blocks(self, num_blocks)
        now = self._clock()
        born, last, hits = self._born, self._last_access, self._hits
        observe = self.enable_caching
        lifetime = self._samples.lifetimes.append
        idle = self._samples.idle_before_evict.append
        every = self.sample_rate >= 1.0
        # NOTE: inlined, names bound outside the loop: this runs for every block handed out.
        for block in blocks:
            i = block.block_id
            t = born[i]
            if t is not None:
                if observe:
                    lifetime(now - t)
                    idle(now - last[i])
                if hits[i] is not None:
                    self._end_hits(i, observe)
            if every or self._rng() < self.sample_rate:
                born[i] = last[i] = now
            elif t is not None:
                born[i] = None
        return blocks

    def _end_hits(self, i: int, observe: bool) -> None:
        history = self._hits[i]
        self._hits[i] = None
        if observe and len(history) > 1:
            times = list(history)
            self._samples.reuse_gaps.extend([b - a for a, b in zip(times, times[1:], strict=False)])

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        BlockPool.touch(self, blocks)
        now = self._clock()
        born, last, hits = self._born, self._last_access, self._hits
        for block in blocks:
            i = block.block_id
            if born[i] is None:
                continue
            last[i] = now
            history = hits[i]
            if history is None:
                hits[i] = history = deque(maxlen=MAX_ACCESS_HISTORY)
            history.append(now)

    def reset_prefix_cache(self) -> bool:
        # As vLLM's collector.reset(): every block starts untracked again.
        if not super().reset_prefix_cache():
            return False
        n = self.num_gpu_blocks
        self._born = [None] * n
        self._hits = [None] * n
        return True

    def take_residency(self) -> ResidencySamples:
        """The observations since the last call (the process loop, once a step)."""
        samples, self._samples = self._samples, ResidencySamples()
        return samples


def residency_pool_factory(sample_rate: float = 1.0) -> Callable[[int, bool, KVEventSink | None], ResidencyBlockPool]:
    """A `KVCacheManager` pool_factory that builds a `ResidencyBlockPool`."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    return partial(ResidencyBlockPool, sample_rate=sample_rate)
