"""Reading a layer's KV blocks for the gather paths (grouped decodes, prefill chunks,
shared prefixes): into a workspace allocated once at start-up, in the dtype SDPA attends
in (``read_dtype``).

A float cache's blocks are gathered with one ``index_select`` per K and V, or read in place
when their ids run consecutively. An fp8 cache's one-byte blocks are gathered as bytes
(index_select has no fp8 kernels everywhere), then converted to float32 in the workspace
(``dequantize``; K unscaled, V times its scale); on CPU the two are one pass of the small C
kernel (``worker.attention.fp8_gather``) where its library is built.
"""

from __future__ import annotations

import torch

from worker.attention.fp8_gather import Fp8Gather
from worker.attention.fp8_gather import load as load_fp8_gather
from worker.attention.kv_quant import KVScales, dequantize


class BlockReader:
    """K and V of a layer's blocks, (m, block_size * kvh * hd) each, in the workspace."""

    def __init__(self, kv_caches: list[torch.Tensor], scales: list[KVScales], read_dtype: torch.dtype, workspace_blocks: int,
                 fp8: bool):
        """kv_caches: one per layer, (2, num_blocks, block_size, kvh, hd); scales: per layer
        (an fp8 cache's); read_dtype: what the gathered blocks reach SDPA in;
        workspace_blocks: the blocks of K (and of V) the workspace holds."""
        self.kv_caches = kv_caches
        self.scales = scales
        self.fp8 = fp8
        _, self.num_blocks, block_size, kvh, hd = kv_caches[0].shape
        block_elems = block_size * kvh * hd
        device = kv_caches[0].device
        self.k_work = torch.empty((workspace_blocks, block_elems), dtype=read_dtype, device=device)
        self.v_work = torch.empty((workspace_blocks, block_elems), dtype=read_dtype, device=device)
        # The fused fp8 read (None: the torch passes below).
        self.fused = load_fp8_gather() if fp8 and Fp8Gather.supports(read_dtype, device) else None
        if fp8:
            # (2, num_blocks, block_elems) uint8 per layer: an fp8 cache is read through byte views.
            self.bytes = [kv.view(torch.uint8).view(2, self.num_blocks, block_elems) for kv in kv_caches]
        if fp8 and self.fused is None:
            # The gathered bytes before conversion.
            self.k_raw = torch.empty((workspace_blocks, block_elems), dtype=torch.uint8, device=device)
            self.v_raw = torch.empty((workspace_blocks, block_elems), dtype=torch.uint8, device=device)

    def gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, in ``read_dtype`` (an fp8 cache's K unscaled: the
        caller's q.k scale carries its scale)."""
        m = block_ids.shape[0]
        if self.fused is not None:
            return self._fused_read(layer, block_ids, 0, m)
        if self.fp8:
            cache = self.bytes[layer]  # (2, num_blocks, block_elems) uint8
            k = torch.index_select(cache[0], 0, block_ids, out=self.k_raw[:m])
            v = torch.index_select(cache[1], 0, block_ids, out=self.v_raw[:m])
            return self._dequantize(layer, k, v)
        cache = self.kv_caches[layer]
        k = torch.index_select(cache[0].view(self.num_blocks, -1), 0, block_ids, out=self.k_work[:m])
        v = torch.index_select(cache[1].view(self.num_blocks, -1), 0, block_ids, out=self.v_work[:m])
        return k, v

    def blocks(self, layer: int, block_ids: torch.Tensor, first_block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``gather``, but blocks whose ids run consecutively (from ``first_block``; None:
        they do not) are read in place (an fp8 cache's are converted from there, without the gather)."""
        if first_block is None:
            return self.gather(layer, block_ids)
        end = first_block + block_ids.shape[0]
        if self.fused is not None:
            return self._fused_read(layer, None, first_block, block_ids.shape[0])
        if self.fp8:
            cache = self.bytes[layer]
            return self._dequantize(layer, cache[0, first_block:end], cache[1, first_block:end])
        cache = self.kv_caches[layer]
        return cache[0].view(self.num_blocks, -1)[first_block:end], cache[1].view(self.num_blocks, -1)[first_block:end]

    def _dequantize(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp8 blocks (m, block_elems), as bytes, -> float32 in the workspace: K unscaled, V
        times its scale. NOTE: vLLM scales the output, not V; the same at 1.0, one rounding
        apart otherwise, and a scaled V keeps the cascade merge's two parts alike."""
        m, fp8, s = k.shape[0], self.kv_caches[layer].dtype, self.scales[layer]
        return dequantize(k, fp8, self.k_work[:m], 1.0), dequantize(v, fp8, self.v_work[:m], s.v)

    def _fused_read(self, layer: int, block_ids: torch.Tensor | None, first: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``gather`` (block_ids) or a consecutive run (None: first ..) of an fp8 cache, one pass each of K and V."""
        cache, fp8, s = self.bytes[layer], self.kv_caches[layer].dtype, self.scales[layer]
        return (self.fused(cache[0], block_ids, first, m, fp8, self.k_work, 1.0),
                self.fused(cache[1], block_ids, first, m, fp8, self.v_work, s.v))
