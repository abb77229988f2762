"""The paged KV write (vLLM's ``reshape_and_cache``): scattering K/V into slots.

One indexed copy each for K and V over all T tokens of a step, whatever blocks they
land in. An fp8 cache gets ``x / scale`` cast to fp8 first (``worker.attention.kv_quant``);
on CPU, float32 and bfloat16 K/V are quantized and scattered in one pass of the C kernel
(``worker.attention.fp8_gather``, the same bytes) where it is built. Slots must be distinct within a call (two tokens never share a position of
one request, and full blocks are never written: DESIGN.md rule 4).
"""

from __future__ import annotations

import numpy as np
import torch

from worker.attention.fp8_gather import load as load_fp8_gather
from worker.attention.kv_quant import UNSCALED, KVScales, is_fp8, quantize
from worker.kv.kv_cache import SAME_SIZE_INT


class KVCacheWriter:
    """Writes into one layer's cache (2, num_blocks, block_size, kvh, hd); the views
    it needs are made once, since the cache is never reallocated."""

    def __init__(self, kv_cache: torch.Tensor, scales: KVScales = UNSCALED):
        _, num_blocks, block_size, kvh, hd = kv_cache.shape
        self.row = kvh * hd
        self.flat = kv_cache.view(2, num_blocks * block_size, self.row)  # a view: writes land in the cache
        self.on_cpu = kv_cache.device.type == "cpu"
        self.fp8 = kv_cache.dtype if is_fp8(kv_cache.dtype) else None
        self.scales = scales
        if self.fp8 is not None and not self.on_cpu:
            # NOTE: index_copy_ has no fp8 kernels; the quantized rows move as bytes.
            self.flat = self.flat.view(torch.uint8)
        # The fused quantize-and-scatter (None: the torch cast, then the copy below).
        self.fused = load_fp8_gather() if self.fp8 is not None and self.on_cpu else None
        if self.fused is not None:
            self.bytes = kv_cache.view(torch.uint8).view(2, num_blocks * block_size, self.row)
        if self.on_cpu:
            self.bits = SAME_SIZE_INT[kv_cache.element_size()]  # the write is a bitwise copy
            cache_np = self.flat.view(self.bits).numpy()  # (2, slots, kvh*hd), shares memory
            self.k_np: np.ndarray = cache_np[0]
            self.v_np: np.ndarray = cache_np[1]

    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key, value: (T, kvh, hd); slot_mapping: (T,) int64."""
        T = key.shape[0]
        if self.fused is not None and self.fused.supports_write(key.dtype):
            self.fused.quantize_write(key.reshape(T, self.row).contiguous(), slot_mapping, self.bytes[0], self.fp8, self.scales.k)
            self.fused.quantize_write(value.reshape(T, self.row).contiguous(), slot_mapping, self.bytes[1], self.fp8, self.scales.v)
            return
        if self.fp8 is not None:
            key = quantize(key, self.fp8, self.scales.k, toward_zero=self.on_cpu)
            value = quantize(value, self.fp8, self.scales.v, toward_zero=self.on_cpu)
            if not self.on_cpu:
                key, value = key.view(torch.uint8), value.view(torch.uint8)
        if self.on_cpu:
            # NOTE: numpy's fancy-index assignment copies each slot's row as one block,
            # closer to copy_'s bandwidth than torch's CPU index_copy_/index_put_
            # (bench/worker_bench.py).
            slots = slot_mapping.numpy()
            self.k_np[slots] = key.reshape(T, self.row).view(self.bits).numpy()
            self.v_np[slots] = value.reshape(T, self.row).view(self.bits).numpy()
        else:
            self.flat[0].index_copy_(0, slot_mapping, key.reshape(T, self.row))
            self.flat[1].index_copy_(0, slot_mapping, value.reshape(T, self.row))

