"""vLLM's PrefixCacheStats: kvpool's counters (scheduler/core/prefix_cache_stats.py)."""

from scheduler.core.prefix_cache_stats import PrefixCacheStats
from vllm.unmapped import module_getattr

__all__ = ["PrefixCacheStats"]
__getattr__ = module_getattr(__name__)
