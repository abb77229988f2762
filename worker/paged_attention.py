"""Paged attention: queries attend to K/V found through the block table.

The tokens of a step are laid out decodes first (one token per request), then prefill
chunks (several consecutive tokens of one request, possibly starting mid-sequence).

* Decodes are batched. Requests are grouped so that a group's blocks fit a workspace
  allocated once at start-up; a group's blocks are gathered with one ``index_select``
  per K and V into the workspace, as (n, ctx, kvh, hd) padded to the group's longest
  context, and attended with SDPA under a padding mask. GQA without copies: the query
  heads of a kv head become SDPA's query-length axis, (n, kvh, group, hd).
  NOTE: grouping keeps the gathered K/V hot in the CPU cache for SDPA (one gather of a
  whole 64 x 1000-token batch is ~1.6x slower than groups of ~8 requests).
* Prefill chunks loop over requests (a chunk is many tokens, so the loop is cheap):
  gather the request's blocks, then SDPA with a causal mask offset by the number of
  tokens already computed.

K/V of the step are written into the cache before attention (``KVCacheWriter``, vLLM's reshape_and_cache),
so every token reads its own K/V, and its request's earlier ones, from the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.cache_ops import KVCacheWriter

DEFAULT_WORKSPACE_BYTES = 16 * 1024 * 1024  # per K and per V


@dataclass(slots=True)
class DecodeGroup:
    start: int  # token range [start, end) among the step's decode tokens
    end: int
    block_ids: torch.Tensor  # (n * num_ctx_blocks,) int64: each row's first blocks
    num_ctx_blocks: int
    mask: torch.Tensor  # (n, 1, 1, num_ctx_blocks * block_size) bool, True = attend


@dataclass(slots=True)
class PrefillChunk:
    start: int  # token range [start, end) in the step batch
    end: int
    block_ids: torch.Tensor  # (num_ctx_blocks,) int64
    num_ctx_blocks: int
    mask: torch.Tensor  # (n, num_ctx_blocks * block_size) bool, causal from num_computed


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_mapping: torch.Tensor  # (T,) int64
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


class PagedAttention:
    """Owns the per-layer caches and the gather workspace; ``for_step`` gives the
    model an AttentionFn bound to one step's metadata."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        num_heads: int,
        max_blocks_per_seq: int,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    ):
        self.kv_caches = kv_caches  # per layer (2, num_blocks, block_size, kvh, hd)
        self.writers = [KVCacheWriter(kv) for kv in kv_caches]
        _, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = kv_caches[0].shape
        self.num_heads = num_heads
        self.group = num_heads // self.num_kv_heads
        block_elems = self.block_size * self.num_kv_heads * self.head_dim
        block_bytes = block_elems * kv_caches[0].element_size()
        # NOTE: at least one whole row, so any single request's context fits.
        self.workspace_blocks = max(max_blocks_per_seq, workspace_bytes // block_bytes)
        dtype, device = kv_caches[0].dtype, kv_caches[0].device
        self._k_work = torch.empty((self.workspace_blocks, block_elems), dtype=dtype, device=device)
        self._v_work = torch.empty((self.workspace_blocks, block_elems), dtype=dtype, device=device)
        self._positions = torch.arange(max_blocks_per_seq * self.block_size, device=device)

    def build_metadata(
        self,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        decode_rows: list[int],
        decode_context_lens: list[int],
        prefills: list[tuple[int, int, int]],
    ) -> AttentionMetadata:
        """block_table: (max_num_seqs, max_blocks_per_seq) int32 on the device.
        decode_rows / decode_context_lens: per decode token, its table row and the
        context it attends to (its position + 1). prefills: (row, num_computed, n)."""
        bs, device = self.block_size, block_table.device
        groups: list[DecodeGroup] = []
        if decode_rows:
            rows = torch.tensor(decode_rows, dtype=torch.long, device=device)  # (B,)
            ctx = torch.tensor(decode_context_lens, dtype=torch.long, device=device)  # (B,)
            start, widest = 0, 0
            for i, n_ctx in enumerate(decode_context_lens + [0]):
                nb = -(-n_ctx // bs)
                at_end = i == len(decode_context_lens)
                if at_end or (i > start and (i - start + 1) * max(widest, nb) > self.workspace_blocks):
                    ids = block_table[rows[start:i], :widest].reshape(-1).long()
                    mask = self._positions[: widest * bs] < ctx[start:i, None]  # (n, L)
                    groups.append(DecodeGroup(start, i, ids, widest, mask[:, None, None, :]))
                    start, widest = i, 0
                widest = max(widest, nb)
        chunks: list[PrefillChunk] = []
        offset = len(decode_rows)
        for row, num_computed, n in prefills:
            nb = -(-(num_computed + n) // bs)
            ids = block_table[row, :nb].long()
            query_pos = torch.arange(num_computed, num_computed + n, device=device)[:, None]  # (n, 1)
            mask = self._positions[: nb * bs][None, :] <= query_pos  # (n, L)
            chunks.append(PrefillChunk(offset, offset + n, ids, nb, mask))
            offset += n
        return AttentionMetadata(slot_mapping, len(decode_rows), groups, chunks)

    def for_step(self, metadata: AttentionMetadata):
        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.forward(layer, q, k, v, metadata)

        return attention

    def _gather(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given blocks, (m, block_size * kvh * hd) each, in the workspace."""
        cache = self.kv_caches[layer]
        m = block_ids.shape[0]
        k = torch.index_select(cache[0].view(self.num_blocks, -1), 0, block_ids, out=self._k_work[:m])
        v = torch.index_select(cache[1].view(self.num_blocks, -1), 0, block_ids, out=self._v_work[:m])
        return k, v

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q (T, nh, hd); k, v (T, kvh, hd) -> (T, nh, hd)."""
        self.writers[layer].write(k, v, md.slot_mapping)
        out = torch.empty_like(q)  # (T, nh, hd)
        kvh, hd = self.num_kv_heads, self.head_dim
        for g in md.decode_groups:
            n, ctx = g.end - g.start, g.num_ctx_blocks * self.block_size
            kg, vg = self._gather(layer, g.block_ids)
            kg = kg.view(n, ctx, kvh, hd).transpose(1, 2)  # (n, kvh, ctx, hd)
            vg = vg.view(n, ctx, kvh, hd).transpose(1, 2)
            qg = q[g.start : g.end].view(n, kvh, self.group, hd)  # (n, kvh, group, hd)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask)  # (n, kvh, group, hd)
            out[g.start : g.end] = o.reshape(n, self.num_heads, hd)
        for c in md.prefills:
            ctx = c.num_ctx_blocks * self.block_size
            kc, vc = self._gather(layer, c.block_ids)
            kc = kc.view(ctx, kvh, hd).transpose(0, 1).unsqueeze(0)  # (1, kvh, ctx, hd)
            vc = vc.view(ctx, kvh, hd).transpose(0, 1).unsqueeze(0)
            qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, enable_gqa=True)  # (1, nh, n, hd)
            out[c.start : c.end] = o[0].transpose(0, 1)
        return out
