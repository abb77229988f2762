"""GroupedBlocks: blocks of one request in each KV-cache group (vLLM's ``KVCacheBlocks``).

A hybrid model's layers are grouped by attention type (protocol.kv_cache_spec); each
group has its own block table over the one shared pool. What the hybrid manager
hands the scheduler (prefix hits, newly allocated blocks) is one list per group.
"""

from __future__ import annotations

from scheduler.core.kv_cache_block import KVCacheBlock


class GroupedBlocks:
    """One list of blocks per KV-cache group, in group order."""

    __slots__ = ("groups",)

    def __init__(self, groups: tuple[list[KVCacheBlock], ...]):
        self.groups = groups

    def __len__(self) -> int:
        # NOTE: prefix hits are equally long in every group (a sliding group's are
        # padded with the null block), so group 0 speaks for all.
        return len(self.groups[0])

    def __bool__(self) -> bool:
        return any(self.groups)

    def get_block_ids(self) -> list[list[int]]:
        return [[b.block_id for b in blocks] for blocks in self.groups]

    def __repr__(self) -> str:
        return f"GroupedBlocks({self.get_block_ids()})"
