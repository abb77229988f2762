"""The paged KV write (vLLM's ``reshape_and_cache``): scattering K/V into slots."""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value (T, kvh, hd) into the slots (T,) int64 of one layer's cache
    (2, num_blocks, block_size, kvh, hd).

    One indexed copy each for K and V over all T tokens, whatever blocks they land in.
    Slots must be distinct within a call (two tokens never share a position of one
    request, and full blocks are never written: DESIGN.md rule 4).
    """
    _, num_blocks, block_size, kvh, hd = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kvh, hd)  # a view: writes land in the cache
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)
