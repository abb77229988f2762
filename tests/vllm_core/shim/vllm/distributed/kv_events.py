"""vLLM's KV events: kvpool's wire events (protocol/kv_events.py: vLLM's Structs, field
for field), which kvpool's core events become by the publisher's `to_wire_event`
(scheduler/engine/kv_event_publisher.py), hashes as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES says."""

from __future__ import annotations

import os

from protocol.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    int_block_hashes_from_env,
)
from scheduler.engine.kv_event_publisher import to_wire_event
from vllm.unmapped import module_getattr

__all__ = ["MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "vllm_events"]
__getattr__ = module_getattr(__name__)


def vllm_events(events, annotate: bool = True) -> list:
    """kvpool's core events as vLLM's. ``annotate=False``: as vLLM's BlockPool alone
    sends them, before its KVCacheManager fills in the group's kind and window."""
    out = [to_wire_event(event, int_block_hashes_from_env(os.environ)) for event in events]
    if not annotate:
        for event in out:
            if isinstance(event, BlockStored):
                event.kv_cache_spec_kind = None
                event.kv_cache_spec_sliding_window = None
    return out
