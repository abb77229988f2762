"""Paged attention: queries attend to K/V found through the block table.

The tokens of a step are laid out decodes first (one token per request), then prefill
chunks (several consecutive tokens of one request, possibly starting mid-sequence).

* Decodes are batched. Requests are grouped so that a group's blocks fit a workspace
  allocated once at start-up; a group's blocks are gathered with one ``index_select``
  per K and V into the workspace, as (n, ctx, kvh, hd) padded to the group's longest
  context, and attended with SDPA under an additive padding mask built once per step
  (None when no row is padded). GQA without copies: the query heads of a kv head become
  SDPA's query-length axis, (n, kvh, group, hd).
  NOTE: grouping keeps the gathered K/V hot in the CPU cache for SDPA (one gather of a
  whole large batch is slower than several groups of a few requests).
* Shared prefixes (cascade attention, as vLLM's ``cascade_attention``; on CPU): decode
  rows whose leading blocks are the same physical blocks (prefix caching) attend to
  those blocks together: the prefix is gathered once per group, not once per row, and
  the group's queries, (1, kvh, m * group, hd), meet it in one SDPA without a mask.
  Each row's own blocks after the prefix go through the grouped path above. The two
  partial results are merged by their log-sum-exps (the flash kernel returns them), so
  the output is softmax over the whole context, up to rounding. A group is formed only
  when it saves at least ``cascade_min_tokens`` gathered tokens.
* Prefill chunks loop over requests (a chunk is many tokens, so the loop is cheap):
  gather the request's blocks, then SDPA with a causal mask offset by the number of
  tokens already computed.

K/V of the step are written into the cache before attention (``KVCacheWriter``, vLLM's reshape_and_cache),
so every token reads its own K/V, and its request's earlier ones, from the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from worker.attention.cache_ops import KVCacheWriter

DEFAULT_WORKSPACE_BYTES = 16 * 1024 * 1024  # per K and per V
# NOTE: a shared-prefix group costs a dozen small ops per layer; below this many
# gathered tokens saved ((rows - 1) x prefix length) the plain path was faster
# (bench/worker_bench.py's shape).
DEFAULT_CASCADE_MIN_TOKENS = 2048

# The CPU flash kernel behind SDPA, which also returns the log-sum-exp of each query's
# scores: what merging two partial attentions needs. Not on other devices.
_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclass(slots=True)
class DecodeGroup:
    start: int  # token range [start, end) among the step's decode tokens
    end: int
    block_ids: torch.Tensor  # (n * num_ctx_blocks,) int64: each row's blocks after its shared prefix
    num_ctx_blocks: int
    bias: torch.Tensor | None  # (n, 1, 1, num_ctx_blocks * block_size), 0 or -inf; None: no padding


@dataclass(slots=True)
class SharedPrefix:
    token_idx: torch.Tensor  # (m,) int64: the group's rows among the decode tokens
    start: int  # the same rows as the range [start, end) of the decode order attention uses
    end: int
    block_ids: torch.Tensor  # (num_blocks,) int64: the prefix every row of the group starts with
    num_blocks: int
    first_block: int | None  # the id of its first block when the ids run consecutively


@dataclass(slots=True)
class PrefillChunk:
    start: int  # token range [start, end) in the step batch
    end: int
    block_ids: torch.Tensor  # (num_ctx_blocks,) int64
    num_ctx_blocks: int
    mask: torch.Tensor  # (n, num_ctx_blocks * block_size) bool, causal from num_computed
    first_block: int | None  # the id of its first block when the ids run consecutively


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_mapping: torch.Tensor  # (T,) int64
    num_decode_tokens: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    shared_prefixes: list[SharedPrefix]
    # With shared prefixes, decode attention runs in an order where each group's rows are
    # adjacent, groups first (the last group ends where the ungrouped rows start):
    # decode_order[j] is the step's decode token at place j.
    decode_order: torch.Tensor | None = None


class PagedAttention:
    """Owns the per-layer caches and the gather workspace; ``for_step`` gives the
    model an AttentionFn bound to one step's metadata."""

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        num_heads: int,
        max_blocks_per_seq: int,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        cascade_min_tokens: int | None = DEFAULT_CASCADE_MIN_TOKENS,
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
        self.dtype = dtype
        # None: no shared-prefix groups (off, or not on CPU where the kernel lives).
        self.cascade_min_tokens = cascade_min_tokens if device.type == "cpu" else None
        self._k_work = torch.empty((self.workspace_blocks, block_elems), dtype=dtype, device=device)
        self._v_work = torch.empty((self.workspace_blocks, block_elems), dtype=dtype, device=device)
        self._positions = torch.arange(max_blocks_per_seq * self.block_size, device=device)

    def _shared_prefixes(self, table: np.ndarray, rows: np.ndarray, ctx: np.ndarray) -> tuple[list[SharedPrefix], np.ndarray]:
        """Groups of decode rows that start with the same blocks; and per decode row, the
        number of leading blocks its group covers (0 outside any group). The groups' rows
        take places [start, end) of the decode order one after another."""
        skip = np.zeros(len(rows), dtype=np.int64)
        groups: list[SharedPrefix] = []
        first = table[rows, 0]
        uniq, inverse, counts = np.unique(first, return_inverse=True, return_counts=True)
        placed = 0
        for k in np.nonzero(counts >= 2)[0]:
            members = np.nonzero(inverse == k)[0]  # indices among the decode tokens
            # NOTE: only whole blocks before each row's last one: the last holds the
            # token being decoded, and every row keeps at least that key of its own.
            limit = int(((ctx[members] - 1) // self.block_size).min())
            if limit == 0:
                continue
            sub = table[rows[members], :limit]  # (m, limit)
            same = (sub == sub[0]).all(axis=0)
            n = limit if same.all() else int(np.argmin(same))
            if n == 0 or (len(members) - 1) * n * self.block_size < self.cascade_min_tokens:
                continue
            skip[members] = n
            ids = sub[0, :n].astype(np.int64)
            groups.append(SharedPrefix(torch.from_numpy(members), placed, placed + len(members), torch.from_numpy(ids), n, _first_if_consecutive(ids)))
            placed += len(members)
        return groups, skip

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
        # NOTE: on the CPU the table is readable as is; elsewhere reading it would wait for the device.
        table_np = block_table.numpy() if device.type == "cpu" else None
        groups: list[DecodeGroup] = []
        shared: list[SharedPrefix] = []
        order = None
        if decode_rows:
            rows_np = np.asarray(decode_rows, dtype=np.int64)
            ctx_np = np.asarray(decode_context_lens, dtype=np.int64)
            skip = np.zeros(len(decode_rows), dtype=np.int64)
            if self.cascade_min_tokens is not None and len(decode_rows) > 1:
                shared, skip = self._shared_prefixes(table_np, rows_np, ctx_np)
            if shared:
                grouped = np.concatenate([s.token_idx.numpy() for s in shared])
                order_np = np.concatenate([grouped, np.setdiff1d(np.arange(len(decode_rows)), grouped)])
                rows_np, ctx_np, skip = rows_np[order_np], ctx_np[order_np], skip[order_np]
                order = torch.from_numpy(order_np).to(device)
            own = ctx_np - skip * bs  # keys of each row after its shared prefix, >= 1
            own_blocks = (-(-own // bs)).tolist()
            own_list = own.tolist()
            rows = torch.from_numpy(rows_np).to(device)  # (B,)
            first_col = torch.from_numpy(skip).to(device)  # (B,)
            max_col = block_table.shape[1] - 1
            start, widest = 0, 0
            for i in range(len(decode_rows) + 1):
                nb = own_blocks[i] if i < len(decode_rows) else 0
                at_end = i == len(decode_rows)
                if at_end or (i > start and (i - start + 1) * max(widest, nb) > self.workspace_blocks):
                    cols = first_col[start:i, None] + torch.arange(widest, device=device)  # (n, widest)
                    # NOTE: columns past a row's blocks read whatever block is there (the
                    # null block or a clamped id); the bias masks them out.
                    ids = block_table[rows[start:i, None], cols.clamp_(max=max_col)].reshape(-1).long()
                    bias = None
                    if any(n_own != widest * bs for n_own in own_list[start:i]):
                        lens = torch.tensor(own_list[start:i], device=device)
                        pad = self._positions[: widest * bs] >= lens[:, None]  # (n, L)
                        bias = torch.zeros(pad.shape, dtype=self.dtype, device=device).masked_fill_(pad, float("-inf"))
                        bias = bias[:, None, None, :]
                    groups.append(DecodeGroup(start, i, ids, widest, bias))
                    start, widest = i, 0
                widest = max(widest, nb)
        chunks: list[PrefillChunk] = []
        offset = len(decode_rows)
        for row, num_computed, n in prefills:
            nb = -(-(num_computed + n) // bs)
            ids = block_table[row, :nb].long()
            query_pos = torch.arange(num_computed, num_computed + n, device=device)[:, None]  # (n, 1)
            mask = self._positions[: nb * bs][None, :] <= query_pos  # (n, L)
            first = _first_if_consecutive(table_np[row, :nb]) if table_np is not None else None
            chunks.append(PrefillChunk(offset, offset + n, ids, nb, mask, first))
            offset += n
        return AttentionMetadata(slot_mapping, len(decode_rows), groups, chunks, shared, order)

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

    def _blocks(self, layer: int, block_ids: torch.Tensor, first_block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``_gather``, but blocks whose ids run consecutively are read in place."""
        if first_block is None:
            return self._gather(layer, block_ids)
        cache, end = self.kv_caches[layer], first_block + block_ids.shape[0]
        return cache[0].view(self.num_blocks, -1)[first_block:end], cache[1].view(self.num_blocks, -1)[first_block:end]

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        """q (T, nh, hd); k, v (T, kvh, hd) -> (T, nh, hd)."""
        self.writers[layer].write(k, v, md.slot_mapping)
        out = torch.empty_like(q)  # (T, nh, hd)
        kvh, hd = self.num_kv_heads, self.head_dim
        if md.num_decode_tokens:
            self._decode(layer, q[: md.num_decode_tokens], out[: md.num_decode_tokens], md)
        for c in md.prefills:
            ctx = c.num_ctx_blocks * self.block_size
            kc, vc = self._blocks(layer, c.block_ids, c.first_block)
            kc = kc.view(ctx, kvh, hd).transpose(0, 1).unsqueeze(0)  # (1, kvh, ctx, hd)
            vc = vc.view(ctx, kvh, hd).transpose(0, 1).unsqueeze(0)
            qc = q[c.start : c.end].transpose(0, 1).unsqueeze(0)  # (1, nh, n, hd)
            o = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=c.mask, enable_gqa=True)  # (1, nh, n, hd)
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
        lse = None
        if md.shared_prefixes:
            # Each decode row's log-sum-exp over its own keys, for the merge below.
            lse = torch.empty((q.shape[0], kvh, grp), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        for g in md.decode_groups:
            n, ctx = g.end - g.start, g.num_ctx_blocks * self.block_size
            kg, vg = self._gather(layer, g.block_ids)
            kg = kg.view(n, ctx, kvh, hd).transpose(1, 2)  # (n, kvh, ctx, hd)
            vg = vg.view(n, ctx, kvh, hd).transpose(1, 2)
            qg = q[g.start : g.end].view(n, kvh, grp, hd)  # (n, kvh, group, hd)
            if lse is None:
                o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.bias)  # (n, kvh, group, hd)
            else:
                o, lse[g.start : g.end] = _flash_with_lse(qg, kg, vg, attn_mask=g.bias)
            res[g.start : g.end] = o.reshape(n, self.num_heads, hd)
        if md.shared_prefixes:
            self._merge_prefixes(layer, q, res, lse, md)
        if md.decode_order is not None:
            out.index_copy_(0, md.decode_order, res)

    def _merge_prefixes(self, layer: int, q: torch.Tensor, res: torch.Tensor, lse: torch.Tensor, md: AttentionMetadata) -> None:
        """Attend each group's queries to its shared prefix, then merge that into ``res``,
        which holds each row's attention over its own keys, whose log-sum-exp is ``lse``.
        Rows are in the decode order, so the groups cover its first rows, up to the last group's end."""
        kvh, hd, grp = self.num_kv_heads, self.head_dim, self.group
        g_rows = md.shared_prefixes[-1].end
        o1 = torch.empty((g_rows, kvh, grp, hd), dtype=q.dtype)
        l1 = torch.empty((g_rows, kvh, grp), dtype=lse.dtype)
        for s in md.shared_prefixes:
            m, ctx = s.end - s.start, s.num_blocks * self.block_size
            kp, vp = self._blocks(layer, s.block_ids, s.first_block)
            kp = kp.view(1, ctx, kvh, hd).transpose(1, 2)  # (1, kvh, ctx, hd)
            vp = vp.view(1, ctx, kvh, hd).transpose(1, 2)
            qp = q[s.start : s.end].view(m, kvh, grp, hd).transpose(0, 1).reshape(1, kvh, m * grp, hd)
            o, lse_p = _flash_with_lse(qp, kp, vp)  # (1, kvh, m * group, hd), (1, kvh, m * group)
            o1[s.start : s.end] = o.view(kvh, m, grp, hd).transpose(0, 1)
            l1[s.start : s.end] = lse_p.view(kvh, m, grp).transpose(0, 1)
        l2 = lse[:g_rows]
        top = torch.maximum(l1, l2)
        w1, w2 = l1.sub_(top).exp_(), l2.sub_(top).exp_()
        total = w1 + w2
        w1, w2 = w1.div_(total).unsqueeze(-1), w2.div_(total).unsqueeze(-1)  # (g_rows, kvh, group, 1)
        o2 = res[:g_rows].view(g_rows, kvh, grp, hd)
        if o2.dtype == w1.dtype:
            o2.mul_(w2).addcmul_(o1, w1)
        else:
            o2.copy_(o1.to(w1.dtype) * w1 + o2.to(w1.dtype) * w2)


def _first_if_consecutive(ids: np.ndarray) -> int | None:
    """ids[0] when the block ids run ids[0], ids[0] + 1, ...; else None."""
    if len(ids) == 0 or (len(ids) > 1 and not (np.diff(ids) == 1).all()):
        return None
    return int(ids[0])
