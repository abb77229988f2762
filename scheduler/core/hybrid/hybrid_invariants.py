"""The invariant check of a hybrid coordinator's tables (`KVCacheManager.check_invariants`)."""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


def check_group_tables(managers: Sequence[SingleTypeKVCacheManager]) -> list[list[KVCacheBlock]]:
    """Every table's blocks, null entries left out, after checking that a request's
    tables are equally long in every group and that a table's null entries are
    exactly its leading ones (none in a full-attention group)."""
    held: list[list[KVCacheBlock]] = []
    lengths: dict[str, int] = {}
    for m in managers:
        for request_id, blocks in m.req_to_blocks.items():
            assert lengths.setdefault(request_id, len(blocks)) == len(blocks), (
                f"{request_id}: tables of unequal length"
            )
            assert m.num_cached_block.get(request_id, 0) <= len(blocks)
            num_null = m.num_null_blocks(request_id)
            assert all(b.is_null for b in blocks[:num_null]), (
                f"{request_id}: a leading entry not null (group {m.group_id})"
            )
            assert not any(b.is_null for b in blocks[num_null:]), (
                f"{request_id}: a null entry after a block (group {m.group_id})"
            )
            held.append(blocks[num_null:])
    return held
