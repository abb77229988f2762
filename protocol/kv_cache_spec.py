"""The bytes of one KV block: the one formula for the worker, which sizes its cache
by it, and the ``kvpool serve`` launcher, which reports the pool's size and may
import neither torch nor ``worker/``.

A block is ``block_size`` tokens of K and V in every layer: the worker's per-layer
tensor is ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (worker/kv_cache.py).
"""

from __future__ import annotations

# --kv-cache-dtype: vLLM 0.32's names its CPU attention backend supports. auto: the
# model's dtype; fp8 means fp8_e4m3 (as vLLM); every fp8 format takes one byte.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_cache_element_size(kv_cache_dtype: str, model_element_size: int) -> int:
    """Bytes of one cache element: the model dtype's for ``auto``, 1 for an fp8 format."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r} (supported: {', '.join(KV_CACHE_DTYPES)})")
    return model_element_size if kv_cache_dtype == "auto" else 1


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V of one block across every layer (vLLM's ``page_size_bytes``, times the
    layers); ``element_size`` is the bytes of one cache element."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
