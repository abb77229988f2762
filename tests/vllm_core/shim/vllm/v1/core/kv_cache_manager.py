"""vLLM's KVCacheManager is not mapped: kvpool's takes plain values (blocks, block size,
windows), not vLLM's KVCacheConfig, and returns its own plan. Only Request is here."""

from vllm.unmapped import module_getattr
from vllm.v1.request import Request

__all__ = ["Request"]
__getattr__ = module_getattr(__name__)
