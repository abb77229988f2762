"""vLLM's attention specs, as far as kvpool's managers read them (block size, window)."""

from __future__ import annotations

from scheduler.core.single_type_kv_cache_manager import AttentionSpec
from vllm.unmapped import module_getattr, refuse

__getattr__ = module_getattr(__name__)


class FullAttentionSpec(AttentionSpec):
    """vLLM's FullAttentionSpec: the layout fields are kept but mean nothing to kvpool's scheduler."""

    __slots__ = ("layout",)

    def __init__(self, block_size: int, sliding_window: int | None = None, **layout):
        if sliding_window is not None or layout.get("attention_chunk_size") is not None:
            refuse("FullAttentionSpec with a window or chunk (vLLM's merged specs)")
        super().__init__(block_size, 0)
        object.__setattr__(self, "layout", layout)


class SlidingWindowSpec(AttentionSpec):
    __slots__ = ("layout",)

    def __init__(self, block_size: int, sliding_window: int, **layout):
        super().__init__(block_size, sliding_window)
        object.__setattr__(self, "layout", layout)
