"""The bytes of one KV block: the one formula for the worker, which sizes its cache
by it, and the ``kvpool serve`` launcher, which reports the pool's size and may
import neither torch nor ``worker/``.

A block is ``block_size`` tokens of K and V in every layer: the worker's per-layer
tensor is ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (worker/kv_cache.py).
"""

from __future__ import annotations


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V of one block across every layer (vLLM's ``page_size_bytes``, times the
    layers); ``element_size`` is the bytes of one cache element."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
