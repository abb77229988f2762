"""Paged attention: queries attend to K/V found through the block table.

The tokens of a step are laid out decodes first (one token per request), then prefill
chunks (several consecutive tokens of one request, possibly starting mid-sequence).
Which kernels read the blocks in place is ``worker.attention.kernels``'s choice: the C
ones below on CPU, on CUDA the Triton kernel (``worker.attention.triton_paged``), which
takes the C kernels' calls.

* Decodes, on CPU where its library is built (float32, bfloat16 and fp8 caches), run one
  C kernel (``worker.attention.paged_decode``) that reads each row's blocks where they
  lie. Elsewhere, or with ``decode_kernel=False``, decodes are batched: requests are
  grouped so that a group's blocks fit a workspace allocated once at start-up; a group's
  blocks are gathered with one ``index_select`` per K and V into the workspace, as (n,
  ctx, kvh, hd) padded to the group's longest context, and attended with SDPA under an
  additive padding mask built once per step (None when no row is padded). GQA without
  copies: the query heads of a kv head become SDPA's query-length axis, (n, kvh, group, hd)
  (``worker.attention.decode_groups``).
* Shared prefixes (cascade attention, ``worker.attention.cascade``; on CPU, by default
  only on the gather path): decode rows whose leading blocks are the same physical
  blocks attend to those blocks together; each row's own blocks after the prefix go
  through the kernel or the grouped path above.
* Prefill chunks, on CPU where its library is built (float32 and bfloat16 caches), run
  one C kernel (``worker.attention.paged_prefill``) for all of a step's chunks, reading
  each chunk's blocks where they lie. Elsewhere, or with ``prefill_kernel=False``, they
  loop over requests: gather the request's blocks, then SDPA with a causal mask offset
  by the number of tokens already computed (``worker.attention.prefill_metadata`` builds
  either's per-step metadata).
* Sliding windows (``build_metadata(..., sliding_window=W)``, one metadata per window;
  ``for_step`` takes one per layer): the token at position p attends to positions
  (p - W, p]. The leading columns of a row wholly before the window of its first query
  are never read (in a sliding KV-cache group they hold the null block), the keys of
  the first column read that fall before the window are masked, and shared prefixes
  are off (a window keeps at most W tokens of any prefix); a long prefill chunk is
  attended in pieces, each reading only the blocks its queries' windows reach.
  Window 0: full attention.

K/V of the step are written into the cache before attention (``KVCacheWriter``, vLLM's reshape_and_cache),
so every token reads its own K/V, and its request's earlier ones, from the pages.

An fp8 cache (``worker.attention.kv_quant``) is read with vLLM's CPU arithmetic
(``cpu_attn_vec.hpp``): every value in float32 (an fp8 value is exact there), the queries
widened, not scaled, q.k times the scale and the K scale (on the logits), float32
probabilities and sums, the output rounded to the compute dtype once. The decode kernel
converts the bytes as it reads them. On the other paths the blocks are converted to
float32 as they are gathered (``worker.attention.block_reader``) for SDPA in float32. NOTE: SDPA in the compute
dtype (bfloat16) rounded the probabilities where vLLM keeps float32, and greedy
continuations parted from vLLM's on most prompts (``bench/kv_dtype_agreement.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from worker.attention.block_reader import BlockReader
from worker.attention.cache_ops import KVCacheWriter
from worker.attention.cascade import (
    DEFAULT_CASCADE_MIN_TOKENS,
    find_shared_prefixes,
    flash_with_lse,
    merge_shared_prefixes,
    shared_first_order,
)
from worker.attention.decode_groups import DecodeGrouper
from worker.attention.kernels import in_place_kernels
from worker.attention.kv_quant import KVScales, is_fp8
from worker.attention.metadata import (
    AttentionMetadata,
    DecodeGroup,
    DecodeRows,
    SharedPrefix,
)
from worker.attention.prefill_metadata import prefill_chunks, prefill_rows

DEFAULT_WORKSPACE_BYTES = 16 * 1024 * 1024  # per K and per V


class PagedAttention:
    """Owns the per-layer caches and the gather workspace; ``for_step`` gives the
    model an AttentionFn bound to one step's metadata."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        num_heads: int,
        max_blocks_per_seq: int,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        cascade_min_tokens: int | None | str = "auto",
        compute_dtype: torch.dtype | None = None,
        kv_scales: list[KVScales] | None = None,
        scale: float | None = None,
        decode_kernel: bool = True,
        prefill_kernel: bool = True,
        kernels: str = "auto",
    ):
        """kv_caches: one per layer; layers may share a tensor (KV-cache groups, vLLM's
        layout). compute_dtype: the queries' (the model's) dtype, None: the caches'; it must
        be given for an fp8 cache. kv_scales: per layer, for an fp8 cache (None: all 1.0).
        scale: of q.k, None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5).
        decode_kernel: decode rows through the in-place kernel where it runs (False: the
        gather and SDPA everywhere). prefill_kernel: prefill chunks through the in-place
        kernel where it runs (False: a gather and SDPA per chunk). kernels: which in-place
        kernels (``worker.attention.kernels``): ``auto``, the C ones on CPU and Triton on
        CUDA; ``triton``, Triton anywhere; ``none``. cascade_min_tokens: shared prefixes are attended
        together when that saves this many gathered tokens; None: never; "auto": never
        where the kernel runs (it gathers nothing, so there is nothing to share, and the
        merge costs), else ``DEFAULT_CASCADE_MIN_TOKENS``."""
        self.kv_caches = kv_caches  # per layer (2, num_blocks, block_size, kvh, hd)
        self.scale = scale
        self.scales = kv_scales or [KVScales()] * len(kv_caches)
        self.writers = [KVCacheWriter(kv, s) for kv, s in zip(kv_caches, self.scales, strict=True)]
        _, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = kv_caches[0].shape
        self.num_heads = num_heads
        # The kernels' scale of q.k (SDPA takes self.scale, None meaning this default).
        self.kernel_scale = scale if scale is not None else self.head_dim**-0.5
        self.group = num_heads // self.num_kv_heads
        cache_dtype, device = kv_caches[0].dtype, kv_caches[0].device
        self.fp8 = is_fp8(cache_dtype)
        if self.fp8 and (compute_dtype is None or is_fp8(compute_dtype)):
            raise ValueError(f"an {cache_dtype} KV cache needs the model's compute dtype, got {compute_dtype}")
        dtype = compute_dtype or cache_dtype
        self.dtype = dtype
        # The dtype the gather paths attend in: an fp8 cache's is float32 (vLLM's CPU kernel).
        self.read_dtype = torch.float32 if self.fp8 else dtype
        block_elems = self.block_size * self.num_kv_heads * self.head_dim
        # NOTE: sized by the dtype the gathered blocks reach SDPA in.
        block_bytes = block_elems * torch.empty((), dtype=self.read_dtype).element_size()
        # NOTE: at least one whole row, so any single request's context fits.
        self.workspace_blocks = max(max_blocks_per_seq, workspace_bytes // block_bytes)
        self.reader = BlockReader(kv_caches, self.scales, self.read_dtype, self.workspace_blocks, self.fp8)
        self._positions = torch.arange(max_blocks_per_seq * self.block_size, device=device)
        self.grouper = DecodeGrouper(self.block_size, self.workspace_blocks, self._positions, self.read_dtype)
        # The in-place kernels (None: the grouped gather and SDPA; a gather and SDPA per chunk).
        self.decode_kernel, self.prefill_kernel = in_place_kernels(kernels, device, cache_dtype, dtype, self.head_dim, self.group,
                                                                   decode_kernel, prefill_kernel, self.block_size, self.num_kv_heads)
        if cascade_min_tokens == "auto":
            cascade_min_tokens = None if self.decode_kernel is not None else DEFAULT_CASCADE_MIN_TOKENS
        # None: no shared-prefix groups (off, or not on CPU where the cascade kernel lives).
        self.cascade_min_tokens = cascade_min_tokens if device.type == "cpu" else None

    def build_metadata(
        self,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        decode_rows: list[int],
        decode_context_lens: list[int],
        prefills: list[tuple[int, int, int]],
        sliding_window: int = 0,
    ) -> AttentionMetadata:
        """block_table: (max_num_seqs, max_blocks_per_seq) int32 on the device.
        decode_rows / decode_context_lens: per decode token, its table row and the
        context it attends to (its position + 1). prefills: (row, num_computed, n).
        sliding_window: W > 0, each token attends to the last W positions, itself
        included; 0, to every earlier one (the table, slots and window of one KV-cache group)."""
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: full attention), got {sliding_window}")
        # NOTE: on the CPU the table is readable as is; elsewhere reading it would wait for the device.
        table_np = block_table.numpy() if block_table.device.type == "cpu" else None
        groups: list[DecodeGroup] | DecodeRows = []
        shared: list[SharedPrefix] = []
        order = None
        if decode_rows:
            groups, shared, order = self._decode_metadata(block_table, table_np, decode_rows, decode_context_lens, sliding_window)
        kernel_prefills = None
        if prefills and self._in_place(self.prefill_kernel, block_table):
            chunks, kernel_prefills = [], prefill_rows(block_table, prefills, len(decode_rows))
        else:
            chunks = prefill_chunks(block_table, table_np, prefills, len(decode_rows), self.block_size, self._positions, sliding_window)
        kernel_rows = groups if isinstance(groups, DecodeRows) else None
        return AttentionMetadata(slot_mapping, len(decode_rows), [] if kernel_rows is not None else groups, chunks, shared, order, sliding_window,
                                 kernel_rows, kernel_prefills)

    def _decode_metadata(
        self, block_table: torch.Tensor, table_np: np.ndarray | None, decode_rows: list[int], decode_context_lens: list[int],
        window: int,
    ) -> tuple[list[DecodeGroup] | DecodeRows, list[SharedPrefix], torch.Tensor | None]:
        """The decode rows' workspace groups (or the rows as the kernel reads them), their
        shared prefixes, and the decode order that puts each prefix's rows together (None
        without shared prefixes)."""
        bs = self.block_size
        rows_np = np.asarray(decode_rows, dtype=np.int64)
        ctx_np = np.asarray(decode_context_lens, dtype=np.int64)
        if window:
            # The first key in the window; the columns wholly before it are skipped and
            # the keys of its column before it masked.
            start = np.maximum(ctx_np - window, 0)
            skip = start // bs
            own = ctx_np - skip * bs
            if self._in_place(self.decode_kernel, block_table):
                return DecodeRows(block_table, rows_np, skip, own, start - skip * bs), [], None
            return self.grouper.groups(block_table, rows_np, own, skip, (start - skip * bs).tolist()), [], None
        skip = np.zeros(len(decode_rows), dtype=np.int64)
        shared: list[SharedPrefix] = []
        order = None
        if self.cascade_min_tokens is not None and len(decode_rows) > 1:
            shared, skip = find_shared_prefixes(table_np, rows_np, ctx_np, bs, self.cascade_min_tokens)
        if shared:
            order_np = shared_first_order(shared, len(decode_rows))
            rows_np, ctx_np, skip = rows_np[order_np], ctx_np[order_np], skip[order_np]
            order = torch.from_numpy(order_np).to(block_table.device)
        own = ctx_np - skip * bs  # keys of each row after its shared prefix, >= 1
        if self._in_place(self.decode_kernel, block_table):
            return DecodeRows(block_table, rows_np, skip, own, np.zeros_like(own)), shared, order
        return self.grouper.groups(block_table, rows_np, own, skip), shared, order

    @staticmethod
    def _in_place(kernel: object | None, block_table: torch.Tensor) -> bool:
        """Whether this step's rows go through ``kernel`` (the decode or prefill one), which
        reads a contiguous int32 block table."""
        return kernel is not None and block_table.dtype == torch.int32 and block_table.is_contiguous()

    def for_step(self, metadata: AttentionMetadata | Sequence[AttentionMetadata]):
        """The model's AttentionFn for one step: one metadata for every layer, or a
        sequence with each layer's (the metadata of its KV-cache group and window; entries shared)."""
        if not isinstance(metadata, AttentionMetadata):
            if len(metadata) != len(self.kv_caches):
                raise ValueError(f"one metadata per layer: {len(self.kv_caches)} layers, got {len(metadata)}")
            per_layer = metadata

            def attention_per_layer(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return self.forward(layer, q, k, v, per_layer[layer])

            return attention_per_layer

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.forward(layer, q, k, v, metadata)

        return attention

    def sdpa_scale(self, layer: int) -> float | None:
        """The scale of q.k on the gather paths: with an fp8 cache times its K scale, on the
        logits (the gathered K is unscaled), as vLLM's CPU kernel; None: SDPA's default."""
        return self.kernel_scale * self.scales[layer].k if self.fp8 else self.scale

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q (T, nh, hd); k, v (T, kvh, hd) -> (T, nh, hd)."""
        self.writers[layer].write(k, v, md.slot_mapping)
        out = torch.empty_like(q)  # (T, nh, hd)
        kvh, hd = self.num_kv_heads, self.head_dim
        if md.num_decode_tokens:
            self._decode(layer, q[: md.num_decode_tokens], out[: md.num_decode_tokens], md)
        if md.prefill_rows is not None:
            r, s = md.prefill_rows, self.scales[layer]
            self.prefill_kernel(q, self.kv_caches[layer], r.table, r.table_row, r.first, r.num_queries, r.offset,
                                md.sliding_window, self.kernel_scale, out, (s.k, s.v))
        for c in md.prefills:
            ctx = c.num_ctx_blocks * self.block_size
            kc, vc = self.reader.blocks(layer, c.block_ids, c.first_block)
            kc = kc.view(ctx, kvh, hd).transpose(0, 1).unsqueeze(0)  # (1, kvh, ctx, hd)
            vc = vc.view(ctx, kvh, hd).transpose(0, 1).unsqueeze(0)
            qc = q[c.start : c.end].to(self.read_dtype).transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, enable_gqa=True, scale=self.sdpa_scale(layer))  # (1, nh, n, hd)
            out[c.start : c.end] = o[0].transpose(0, 1)
        return out

    def _decode(self, layer: int, q: torch.Tensor, out: torch.Tensor, md: AttentionMetadata) -> None:
        """q (B, nh, hd), the step's decode tokens -> out (B, nh, hd)."""
        kvh, hd, grp = self.num_kv_heads, self.head_dim, self.group
        if md.decode_order is not None:
            q = q.index_select(0, md.decode_order)  # the groups' rows adjacent
            res = torch.empty_like(q)
        else:
            res = out
        qr = q.to(self.read_dtype)  # the gather paths' queries (B, nh, hd)
        lse = None
        if md.shared_prefixes:
            # Each decode row's log-sum-exp over its own keys, for the merge below.
            lse = torch.empty((q.shape[0], kvh, grp), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32, device=q.device)
        if md.decode_rows is not None:
            r = md.decode_rows
            if q.stride(1) != hd or q.stride(2) != 1:
                q = q.contiguous()
            s = self.scales[layer]
            self.decode_kernel(q, self.kv_caches[layer], r.table, r.table_row, r.first_col, r.num_keys, r.lead, self.kernel_scale, res, lse, (s.k, s.v))
        for g in md.decode_groups:
            n, ctx = g.end - g.start, g.num_ctx_blocks * self.block_size
            kg, vg = self.reader.gather(layer, g.block_ids)
            kg = kg.view(n, ctx, kvh, hd).transpose(1, 2)  # (n, kvh, ctx, hd)
            vg = vg.view(n, ctx, kvh, hd).transpose(1, 2)
            qg = qr[g.start : g.end].view(n, kvh, grp, hd)  # (n, kvh, group, hd)
            if lse is None:
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.bias, scale=self.sdpa_scale(layer))  # (n, kvh, group, hd)
            else:
                o, lse[g.start : g.end] = flash_with_lse(qg, kg, vg, attn_mask=g.bias, scale=self.sdpa_scale(layer))
            res[g.start : g.end] = o.reshape(n, self.num_heads, hd)
        if md.shared_prefixes:
            merge_shared_prefixes(qr, res, lse, md.shared_prefixes, lambda ids, first: self.reader.blocks(layer, ids, first), self.block_size,
                                  self.sdpa_scale(layer))
        if md.decode_order is not None:
            out.index_copy_(0, md.decode_order, res)
