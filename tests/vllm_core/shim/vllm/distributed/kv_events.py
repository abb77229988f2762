"""vLLM's KV events: kvpool's (scheduler/core/kv_events.py)."""

from protocol.kv_events import MEDIUM_GPU
from scheduler.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.unmapped import module_getattr

__all__ = ["MEDIUM_GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored"]
__getattr__ = module_getattr(__name__)
