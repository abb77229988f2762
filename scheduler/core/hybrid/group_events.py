"""KV events of a hybrid pool: the pool keys its hashes by (hash, group)
(scheduler/core/single_type_kv_cache_manager.py, `group_key`); routers get the
request's own hash and, as vLLM 0.32's BlockPool and KVCacheManager.take_events
fill them, the group's index, kind and sliding window."""

from __future__ import annotations

from collections.abc import Sequence

from protocol.kv_events import MEDIUM_GPU
from scheduler.core.kv_cache_block import BlockHash
from scheduler.core.kv_events import KVEventSink

GROUP_KEY_BYTES = 4


def split_group_key(key: BlockHash) -> tuple[BlockHash, int]:
    """(the request's hash, the group) of a pool key."""
    return key[:-GROUP_KEY_BYTES], int.from_bytes(key[-GROUP_KEY_BYTES:], "big")


class GroupKeyedEventSink:
    """Passes the pool's events on to ``sink`` with the group taken out of the hashes."""

    __slots__ = ("sink", "group_windows")

    def __init__(self, sink: KVEventSink, group_windows: Sequence[int]):
        self.sink = sink
        self.group_windows = list(group_windows)

    def block_stored(
        self, block_hashes, parent_block_hash, token_ids, block_size, medium: str = MEDIUM_GPU
    ) -> None:
        # NOTE: the pool stores one group's blocks per event; the host tier's completed stores
        # mix groups (no parent, no tokens): one event per run of one group's hashes.
        start, n = 0, len(block_hashes)
        for end in range(1, n + 1):
            if end < n and block_hashes[end][-GROUP_KEY_BYTES:] == block_hashes[start][-GROUP_KEY_BYTES:]:
                continue
            raw, group = split_group_key(block_hashes[start])
            hashes = [raw, *(h[:-GROUP_KEY_BYTES] for h in block_hashes[start + 1 : end])]
            parent = None if parent_block_hash is None or start else parent_block_hash[:-GROUP_KEY_BYTES]
            self.sink.block_stored(
                hashes,
                parent,
                token_ids,
                block_size,
                medium,
                group_idx=group,
                sliding_window=self.group_windows[group],
            )
            start = end

    def block_removed(self, block_hash: BlockHash, medium: str = MEDIUM_GPU) -> None:
        raw, group = split_group_key(block_hash)
        self.sink.block_removed(raw, medium, group_idx=group)

    def all_blocks_cleared(self) -> None:
        self.sink.all_blocks_cleared()
