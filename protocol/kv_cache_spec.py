"""The bytes of one KV block: the one formula for the worker, which sizes its cache
by it, and the ``kvpool serve`` launcher, which reports the pool's size and may
import neither torch nor ``worker/``.

A block is ``block_size`` tokens of K and V in every layer: the worker's per-layer
tensor is ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (worker/kv/kv_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

# --kv-cache-dtype: vLLM 0.32's names its CPU attention backend supports. auto: the
# model's dtype; fp8 means fp8_e4m3 (as vLLM); every fp8 format takes one byte.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# Tokens per KV block unless --block-size says otherwise (vLLM's default on CUDA and CPU):
# the one place every process, `kvpool serve` and the simulator take it from.
DEFAULT_BLOCK_SIZE = 16


def kv_cache_element_size(kv_cache_dtype: str, model_element_size: int) -> int:
    """Bytes of one cache element: the model dtype's for ``auto``, 1 for an fp8 format."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r} (supported: {', '.join(KV_CACHE_DTYPES)})")
    return model_element_size if kv_cache_dtype == "auto" else 1


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """K and V of one block across every layer (vLLM's ``page_size_bytes``, times the
    layers); ``element_size`` is the bytes of one cache element."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


# --- hybrid KV-cache groups (vLLM's kv_cache_groups) --------------------------------------


class KVCacheGroupSpec(msgspec.Struct, frozen=True, array_like=True):
    """Layers that share one block table: one attention type, one window.

    ``sliding_window`` 0 is full attention; W > 0: each token attends to the last W
    tokens, itself included, and the group's blocks wholly before that are freed."""

    layer_ids: list[int]
    sliding_window: int = 0


def kv_cache_groups(layer_windows: Sequence[int], disable_hybrid: bool = False) -> list[KVCacheGroupSpec]:
    """vLLM 0.32's grouping of layers with one page size (``kv_cache_utils``,
    ``_get_kv_cache_groups_uniform_page_size``). ``layer_windows[i]``: layer i's window,
    0 for full attention.

    Every layer alike (all full, or all the same window): one group of every layer, as
    today. Otherwise layers are bucketed by window in order of first appearance; a
    group holds ``group_size`` layers (the smallest bucket's count, or the largest's
    when it is under 1.5 times the smallest), and a bucket of n layers becomes
    ceil(n / group_size) groups, group i taking ``layers[i::num_groups]``.
    ``disable_hybrid`` (vLLM's --disable-hybrid-kv-cache-manager): every layer's KV is
    kept as full attention's, one group (the layers still attend within their windows);
    refused (ValueError), as by vLLM, when the layers have several window sizes."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer")
    if any(w < 0 for w in layer_windows):
        raise ValueError(f"sliding windows must be >= 0 (0: full attention), got {list(layer_windows)}")
    windows = set(layer_windows)
    if disable_hybrid and len(windows) > 1:
        if len(windows - {0}) > 1:
            # NOTE: as vLLM 0.32, which cannot merge layers of several windows into one group.
            raise ValueError(
                f"--disable-hybrid-kv-cache-manager needs at most one sliding window size, got {sorted(windows - {0})}"
            )
        windows = {0}
    if len(windows) == 1:
        return [KVCacheGroupSpec(list(range(len(layer_windows))), windows.pop())]
    buckets: dict[int, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        buckets.setdefault(window, []).append(layer)
    sizes = [len(b) for b in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups: list[KVCacheGroupSpec] = []
    for window, layers in buckets.items():
        num_groups = -(-len(layers) // group_size)
        groups.extend(KVCacheGroupSpec(layers[i::num_groups], window) for i in range(num_groups))
    return groups


def is_hybrid(group_windows: Sequence[int]) -> bool:
    """Whether groups of these windows need the hybrid manager: several groups, or one
    sliding-window group ([] and [0]: one full-attention group, every model before groups)."""
    return len(group_windows) > 1 or any(group_windows)


def num_kv_tensors(groups: Sequence[KVCacheGroupSpec]) -> int:
    """KV tensors a worker allocates for ``groups`` (vLLM's layout): tensor j is shared by
    the j-th layer of every group, so a block id means the same memory in every group
    and the pool's blocks cost ``num_kv_tensors`` layers each, not every layer."""
    return max(len(g.layer_ids) for g in groups)


def layer_tensor_index(groups: Sequence[KVCacheGroupSpec]) -> dict[int, int]:
    """layer -> the KV tensor it reads and writes (its place in its group)."""
    return {layer: j for g in groups for j, layer in enumerate(g.layer_ids)}
