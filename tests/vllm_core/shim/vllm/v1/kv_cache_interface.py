"""vLLM's attention specs and KV-cache config, as far as kvpool's managers read them:
block size and window per group, the groups, and the number of blocks.

kvpool's scheduler reads no tensor layout (the worker owns the memory): the layout
fields vLLM's specs carry (heads, head size, dtype, padding) are kept but unread, and
the config's tensors likewise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.kv_events import KV_CACHE_SPEC_KIND_FULL_ATTENTION, KV_CACHE_SPEC_KIND_SLIDING_WINDOW
from scheduler.core.single_type_kv_cache_manager import AttentionSpec
from vllm.unmapped import module_getattr, refuse

__getattr__ = module_getattr(__name__)


class KVCacheSpecKind(enum.Enum):
    """vLLM's spec kinds that kvpool's groups have (the kinds its KV events name)."""

    FULL_ATTENTION = KV_CACHE_SPEC_KIND_FULL_ATTENTION
    SLIDING_WINDOW = KV_CACHE_SPEC_KIND_SLIDING_WINDOW


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


@dataclass
class KVCacheGroupSpec:
    """vLLM's KVCacheGroupSpec: the layers of one group and their spec."""

    layer_names: list[str]
    kv_cache_spec: AttentionSpec
    # The draft model's group under EAGLE: kvpool has no EAGLE, the manager refuses it.
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    """vLLM's KVCacheConfig: the pool's size and the groups (the tensors are the worker's)."""

    num_blocks: int
    kv_cache_tensors: list = field(default_factory=list)
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)
