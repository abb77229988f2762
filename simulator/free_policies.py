"""Where freed blocks go: vLLM's rule and two older designs, for what-if studies.

* ``vllm`` (default): unhashed blocks to the front, hashed to the back, a
  request's blocks freed last-first (BlockPool + KVCacheManager as they are).
* ``tail``: the design in vLLM's published design document: every freed block to
  the back. Unhashed blocks then sit behind cached ones, so cached data is evicted
  while useless blocks are still free.
* ``forward``: vLLM's queue rule, but a request's blocks freed first-block-first,
  so the first block of a shared system prompt is the first to be evicted.

Each policy is a BlockPool subclass, handed to ``KVCacheManager(pool_factory=...)``:
the scheduler itself knows nothing of what-if policies.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_block import KVCacheBlock

FREE_POLICIES = ("vllm", "tail", "forward")


class TailBlockPool(BlockPool):
    """Every block reaching ref_cnt 0 goes to the back, in the order given."""

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        freed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                freed.append(block)
        self.free_block_queue.append_n(freed)
        self.num_free_cached_blocks += sum(1 for b in freed if b.block_hash is not None)


class ForwardBlockPool(BlockPool):
    """vLLM's queue rule over the blocks in table order: the manager frees a request
    last block first, so this pool puts them back first block first."""

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        super().free_blocks(list(ordered_blocks)[::-1])


def pool_class(policy: str) -> type[BlockPool]:
    """The pool factory for a policy name (``KVCacheManager(pool_factory=...)``)."""
    if policy not in FREE_POLICIES:
        raise ValueError(f"unknown free policy {policy!r}; choose one of {', '.join(FREE_POLICIES)}")
    return {"vllm": BlockPool, "tail": TailBlockPool, "forward": ForwardBlockPool}[policy]
