"""KVCacheBlocks: blocks of one request in each KV-cache group (vLLM's ``KVCacheBlocks``).

What the KV-cache manager hands the scheduler (prefix hits, newly allocated blocks) is
one list per group, in group order: one list for most models, several for a hybrid
model, whose layers are grouped by attention type (protocol.kv_cache_spec), each group
with its own block table over the one shared pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from scheduler.core.kv_cache_block import KVCacheBlock


class KVCacheBlocks(msgspec.Struct, gc=False):
    """One sequence of blocks per KV-cache group, in group order.

    NOTE: a Struct for its constructor, written in C: the one-group decode path makes one at
    every block boundary of every running request (a class with __init__ cost 2.5x as much)."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __len__(self) -> int:
        # NOTE: prefix hits are equally long in every group (a sliding group's are
        # padded with the null block), so group 0 speaks for all.
        return len(self.blocks[0])

    def __bool__(self) -> bool:
        return any(self.blocks)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks] for blocks in self.blocks)

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


# The one-group coordinator's answer when a call allocated no block (most decode calls):
# ``is`` tells it apart on the decode path, where calling __bool__ would cost.
NO_NEW_BLOCKS = KVCacheBlocks(([],))
