"""Shared prefixes in decode: cascade attention, as vLLM's ``cascade_attention`` (on CPU).

Decode rows whose leading blocks are the same physical blocks (prefix caching) attend to
those blocks together: the prefix is gathered once per group, not once per row, and the
group's queries, (1, kvh, m * group, hd), meet it in one SDPA without a mask. Each row's
own blocks after the prefix go through the grouped decode path (``PagedAttention``).
The two partial results are merged by their log-sum-exps (the flash kernel returns
them), so the output is softmax over the whole context, up to rounding. A group is
formed only when it saves at least ``cascade_min_tokens`` gathered tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from worker.attention.metadata import SharedPrefix, first_if_consecutive

# NOTE: a shared-prefix group costs a dozen small ops per layer; below this many
# gathered tokens saved ((rows - 1) x prefix length) the plain path was faster
# (bench/worker_bench.py's shape).
DEFAULT_CASCADE_MIN_TOKENS = 2048

# The CPU flash kernel behind SDPA, which also returns the log-sum-exp of each query's
# scores: what merging two partial attentions needs. Not on other devices.
flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# Reads a run of blocks of one layer: (block_ids, first_block) -> K, V, (m, block_size * kvh * hd) each.
ReadBlocks = Callable[[torch.Tensor, int | None], tuple[torch.Tensor, torch.Tensor]]


def find_shared_prefixes(
    table: np.ndarray, rows: np.ndarray, ctx: np.ndarray, block_size: int, min_tokens: int
) -> tuple[list[SharedPrefix], np.ndarray]:
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
        limit = int(((ctx[members] - 1) // block_size).min())
        if limit == 0:
            continue
        sub = table[rows[members], :limit]  # (m, limit)
        same = (sub == sub[0]).all(axis=0)
        n = limit if same.all() else int(np.argmin(same))
        if n == 0 or (len(members) - 1) * n * block_size < min_tokens:
            continue
        skip[members] = n
        ids = sub[0, :n].astype(np.int64)
        groups.append(SharedPrefix(torch.from_numpy(members), placed, placed + len(members), torch.from_numpy(ids), n, first_if_consecutive(ids)))
        placed += len(members)
    return groups, skip


def shared_first_order(shared: list[SharedPrefix], num_decode: int) -> np.ndarray:
    """The decode order: each group's rows adjacent, groups first, then the ungrouped rows."""
    grouped = np.concatenate([s.token_idx.numpy() for s in shared])
    return np.concatenate([grouped, np.setdiff1d(np.arange(num_decode), grouped)])


def merge_shared_prefixes(
    q: torch.Tensor, res: torch.Tensor, lse: torch.Tensor, shared: list[SharedPrefix], read_blocks: ReadBlocks, block_size: int,
    scale: float | None = None,
) -> None:
    """Attend each group's queries to its shared prefix, then merge that into ``res``,
    which holds each row's attention over its own keys, whose log-sum-exp is ``lse``.
    Rows are in the decode order, so the groups cover its first rows, up to the last group's end.
    q, res (B, nh, hd); lse (B, kvh, group). scale: of q.k, None: head_dim ** -0.5."""
    o1, l1 = _attend_prefixes(q, lse, shared, read_blocks, block_size, scale)
    _merge(res, lse, o1, l1)


def _attend_prefixes(
    q: torch.Tensor, lse: torch.Tensor, shared: list[SharedPrefix], read_blocks: ReadBlocks, block_size: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's queries over its prefix: the output (g_rows, kvh, group, hd) and its
    log-sum-exp (g_rows, kvh, group), in the decode order."""
    _, kvh, grp = lse.shape
    hd = q.shape[-1]
    g_rows = shared[-1].end
    o1 = torch.empty((g_rows, kvh, grp, hd), dtype=q.dtype, device=q.device)
    l1 = torch.empty((g_rows, kvh, grp), dtype=lse.dtype, device=q.device)
    for s in shared:
        m, ctx = s.end - s.start, s.num_blocks * block_size
        kp, vp = read_blocks(s.block_ids, s.first_block)
        kp = kp.view(1, ctx, kvh, hd).transpose(1, 2)  # (1, kvh, ctx, hd)
        vp = vp.view(1, ctx, kvh, hd).transpose(1, 2)
        qp = q[s.start : s.end].view(m, kvh, grp, hd).transpose(0, 1).reshape(1, kvh, m * grp, hd)
        o, lse_p = flash_with_lse(qp, kp, vp, scale=scale)  # (1, kvh, m * group, hd), (1, kvh, m * group)
        o1[s.start : s.end] = o.view(kvh, m, grp, hd).transpose(0, 1)
        l1[s.start : s.end] = lse_p.view(kvh, m, grp).transpose(0, 1)
    return o1, l1


def _merge(res: torch.Tensor, lse: torch.Tensor, o1: torch.Tensor, l1: torch.Tensor) -> None:
    """res[:g_rows] = softmax-weighted sum of the prefix part (o1, l1) and the own part
    (res, lse), in place; the weights are each part's exp(log-sum-exp - the larger one)."""
    g_rows, kvh, grp, hd = o1.shape
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
