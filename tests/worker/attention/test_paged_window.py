"""Sliding-window paged attention: each token at position p attends to positions
(p - W, p], checked against attention computed densely in float64 from the sequences'
own K/V (no paging code involved) with the window's mask.

The block table is a sliding KV-cache group's, as the scheduler leaves it: the columns
wholly before the window of a row's first query of the step hold the null block (block
0), which is filled with NaN here, so any read of it would show in the output. Columns
past a row's blocks hold PAD, a block of finite garbage that padding may read and must
mask. The window (6) is not a multiple of the block size (4), so the first column read
holds keys before the window that must be masked too.
"""

from __future__ import annotations

import random

import pytest
import torch

from worker.attention.kv_quant import KVScales
from worker.attention.paged_attention import PagedAttention

BS, NH, KVH, HD, W, NUM_BLOCKS, MAX_BLOCKS = 4, 4, 2, 8, 6, 64, 12
PAD = NUM_BLOCKS - 1
SCALE = 0.3  # not head_dim ** -0.5: the scale reaches every path
# Step 1: (seq, num_computed, n) prefill chunks; step 2: prefill chunks and decodes
# (n = 1). Seq 0 is prefilled in two chunks, the second past its window; seq 2 stays
# within the window; seq 3 decodes with its first column before the window.
STEP1 = [(0, 0, 14), (1, 0, 9), (2, 0, 3), (3, 0, 17)]
STEP2 = [(1, 9, 1), (2, 3, 1), (3, 17, 1), (0, 14, 9)]


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, window: int) -> torch.Tensor:
    """q (nh, hd) at position ``pos`` over k, v (>= pos + 1, kvh, hd), float64 -> (nh, hd)."""
    lo = max(0, pos - window + 1) if window else 0
    out = torch.empty(NH, HD, dtype=torch.float64)
    for h in range(NH):
        kv = h // (NH // KVH)
        p = torch.softmax(k[lo : pos + 1, kv].double() @ q[h].double() * SCALE, dim=0)  # (keys,)
        out[h] = p @ v[lo : pos + 1, kv].double()
    return out


class Sequences:
    """Each sequence's K/V, block ids and a block table with the null block before its window."""

    def __init__(self, num_seqs: int, length: int, dtype: torch.dtype, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        free = list(range(1, PAD))
        random.Random(seed).shuffle(free)
        self.blocks = [[free.pop() for _ in range(MAX_BLOCKS)] for _ in range(num_seqs)]
        self.k = torch.randn(num_seqs, length, KVH, HD, generator=self.gen, dtype=torch.float64)
        self.v = torch.randn(num_seqs, length, KVH, HD, generator=self.gen, dtype=torch.float64)
        self.table = torch.tensor(self.blocks, dtype=torch.int32)

    def null_before(self, seq: int, first_query: int, window: int) -> None:
        """What a sliding-window manager frees: the columns wholly before the window."""
        self.table[seq, : max(0, first_query - window + 1) // BS] = 0

    def pad_after(self, seq: int, num_tokens: int) -> None:
        """The row's blocks for ``num_tokens`` tokens, PAD after them."""
        nb = -(-num_tokens // BS)
        self.table[seq, :nb] = torch.tensor(self.blocks[seq][:nb], dtype=torch.int32)
        self.table[seq, nb:] = PAD

    def step(
        self, attention: PagedAttention, chunks: list[tuple[int, int, int]], window: int
    ) -> dict[tuple[int, int], torch.Tensor]:
        """Run one step (decodes first, as the runner lays them out); per (seq, position), the output."""
        order = sorted(chunks, key=lambda c: c[2] != 1)
        seq_of, pos_of, slots = [], [], []
        for seq, c, n in order:
            for p in range(c, c + n):
                seq_of.append(seq)
                pos_of.append(p)
                slots.append(self.blocks[seq][p // BS] * BS + p % BS)
        decodes = [(s, c) for s, c, n in order if n == 1]
        prefills = [(s, c, n) for s, c, n in order if n > 1]
        md = attention.build_metadata(
            self.table,
            torch.tensor(slots),
            [s for s, _ in decodes],
            [c + 1 for _, c in decodes],
            prefills,
            window,
        )
        q = torch.randn(len(slots), NH, HD, generator=self.gen, dtype=torch.float64)
        k = torch.stack([self.k[s, p] for s, p in zip(seq_of, pos_of, strict=True)])  # (T, kvh, hd)
        v = torch.stack([self.v[s, p] for s, p in zip(seq_of, pos_of, strict=True)])
        with torch.inference_mode():
            out = attention.for_step(md)(0, q.to(self.dtype), k.to(self.dtype), v.to(self.dtype))
        self.q = {(s, p): q[i] for i, (s, p) in enumerate(zip(seq_of, pos_of, strict=True))}
        return {(s, p): out[i] for i, (s, p) in enumerate(zip(seq_of, pos_of, strict=True))}


def make_cache(dtype: torch.dtype) -> torch.Tensor:
    cache = torch.zeros((2, NUM_BLOCKS, BS, KVH, HD), dtype=dtype)
    cache[:, PAD] = torch.full((2, BS, KVH, HD), 7.0).to(dtype)  # finite garbage, masked
    return cache


def run_two_steps(cache: torch.Tensor, compute: torch.dtype, window: int, kv_scales=None):
    seqs = Sequences(4, 24, compute)
    attention = PagedAttention(
        [cache], NH, MAX_BLOCKS, compute_dtype=compute, kv_scales=kv_scales, scale=SCALE
    )
    for seq, c, n in STEP1:
        seqs.pad_after(seq, c + n)
    out1, q1 = seqs.step(attention, STEP1, window), seqs.q
    if window:
        # The null block is all NaN from here on: a read of it would reach the output.
        cache[:, 0] = float("nan")
    for seq, c, n in STEP2:
        seqs.pad_after(seq, c + n)
        if window:
            seqs.null_before(seq, c, window)
    out2, q2 = seqs.step(attention, STEP2, window), seqs.q
    return seqs, {**out1, **out2}, {**q1, **q2}


@pytest.mark.parametrize("window", [W, 0])
def test_windowed_prefill_and_decode_equal_dense_float64(window):
    cache = make_cache(torch.float64)
    seqs, out, q = run_two_steps(cache, torch.float64, window)
    assert len(out) == sum(n for _, _, n in STEP1 + STEP2)
    if window:
        # Nulled: seq 0's chunk from 14 (keys from 9), 2 columns; seq 1 at 9, 1; seq 3 at 17, 3.
        assert (seqs.table == 0).sum(dim=1).tolist() == [2, 1, 0, 3]
        assert torch.isnan(cache[:, 0]).all()
    for (seq, pos), o in out.items():
        assert torch.isfinite(o).all(), (seq, pos)
        ref = dense(q[seq, pos], seqs.k[seq], seqs.v[seq], pos, window)
        torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-12, msg=f"seq {seq} pos {pos}")


def test_window_changes_the_output_past_the_window():
    # NOTE: the reference itself must tell the window from full attention, or the
    # test above could pass with the window ignored.
    seqs, out, q = run_two_steps(make_cache(torch.float64), torch.float64, W)
    ref_full = dense(q[3, 17], seqs.k[3], seqs.v[3], 17, 0)
    assert (out[3, 17] - ref_full).abs().max() > 1e-3
    # Within the window (seq 2, position 3) window and full attention agree.
    torch.testing.assert_close(
        out[2, 3], dense(q[2, 3], seqs.k[2], seqs.v[2], 3, 0), rtol=1e-12, atol=1e-12
    )


def test_windowed_metadata_skips_leading_columns_and_shares_no_prefix():
    seqs = Sequences(2, 24, torch.float64)
    seqs.table[1] = seqs.table[0]  # the same blocks: a shared prefix, were it full attention
    attention = PagedAttention([make_cache(torch.float64)], NH, MAX_BLOCKS, cascade_min_tokens=1)
    md = attention.build_metadata(
        seqs.table, torch.tensor([0, 1, 2]), [0, 1], [20, 20], [(0, 13, 1)], W
    )
    assert md.sliding_window == W and md.shared_prefixes == [] and md.decode_order is None
    # Position 19 attends to keys 14..19: columns 3 and 4, keys 12 and 13 masked.
    (group,) = md.decode_groups
    assert group.num_ctx_blocks == 2
    assert group.block_ids.tolist() == [seqs.blocks[0][3], seqs.blocks[0][4]] * 2
    assert (group.bias[:, 0, 0] == float("-inf")).tolist() == [[True, True] + [False] * 6] * 2
    (chunk,) = md.prefills  # query 13: keys 8..13, columns 2 and 3
    assert chunk.num_ctx_blocks == 2 and chunk.block_ids.tolist() == seqs.blocks[0][2:4]
    full = attention.build_metadata(
        seqs.table, torch.tensor([0, 1, 2]), [0, 1], [20, 20], [(0, 13, 1)]
    )
    assert (
        full.sliding_window == 0
        and len(full.shared_prefixes) == 1
        and full.prefills[0].num_ctx_blocks == 4
    )
    with pytest.raises(ValueError, match="sliding_window must be >= 0"):
        attention.build_metadata(seqs.table, torch.tensor([0]), [0], [3], [], -1)


def test_fp8_cache_windowed_equals_dense_over_its_dequantized_contents():
    cache = make_cache(torch.float8_e4m3fn)
    scales = KVScales(0.5, 2.0)
    seqs, out, q = run_two_steps(cache, torch.float32, W, [scales])
    for (seq, pos), o in out.items():
        # The reference reads what the cache holds (quantized), from the sequence's own blocks.
        blocks = seqs.blocks[seq]
        k = cache[0, blocks].reshape(-1, KVH, HD).double() * scales.k
        v = cache[1, blocks].reshape(-1, KVH, HD).double() * scales.v
        assert torch.isfinite(o).all(), (seq, pos)
        torch.testing.assert_close(
            o.double(),
            dense(q[seq, pos], k, v, pos, W),
            rtol=1e-5,
            atol=1e-5,
            msg=f"seq {seq} pos {pos}",
        )


def test_per_layer_metadata_with_a_shared_tensor():
    # Two layers share one KV tensor (vLLM's layout for two groups): layer 0 in a sliding
    # group, layer 1 in a full group, each through its own group's table, slots and window.
    cache = make_cache(torch.float64)
    attention = PagedAttention([cache, cache], NH, MAX_BLOCKS, scale=SCALE)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randperm(PAD - 1, generator=gen)[:10] + 1  # one pool: ids unique across groups
    n = 5 * BS
    q = torch.randn(n, NH, HD, generator=gen, dtype=torch.float64)
    kv = torch.randn(
        2, 2, n, KVH, HD, generator=gen, dtype=torch.float64
    )  # (layer, k|v, T, kvh, hd)
    mds = []
    for group, window in ((0, W), (1, 0)):
        blocks = ids[5 * group : 5 * group + 5]
        table = torch.full((1, MAX_BLOCKS), PAD, dtype=torch.int32)
        table[0, :5] = blocks
        slots = (blocks[:, None] * BS + torch.arange(BS)).reshape(-1)  # (T,)
        mds.append(attention.build_metadata(table, slots, [], [], [(0, 0, n)], window))
    fn = attention.for_step(mds)
    with torch.inference_mode():
        outs = [fn(layer, q, kv[layer, 0], kv[layer, 1]) for layer in (0, 1)]
    for layer, window in ((0, W), (1, 0)):
        blocks = ids[5 * layer : 5 * layer + 5]
        assert torch.equal(
            cache[0, blocks].reshape(n, KVH, HD), kv[layer, 0]
        )  # neither layer overwrote the other
        for p in range(n):
            ref = dense(q[p], kv[layer, 0], kv[layer, 1], p, window)
            torch.testing.assert_close(
                outs[layer][p], ref, rtol=1e-12, atol=1e-12, msg=f"layer {layer} pos {p}"
            )
    with pytest.raises(ValueError, match="one metadata per layer"):
        attention.for_step(mds[:1])


@pytest.mark.parametrize(
    ("window", "pieces"),
    [
        (6, [(0, 256, 64), (256, 300, 13)]),
        (100, [(0, 256, 64), (256, 300, 36)]),
        (300, [(0, 300, 75)]),
    ],
)
def test_a_long_windowed_chunk_is_attended_in_pieces(window, pieces):
    # 300 queries in one chunk: pieces of max(W, 256) queries, each reading from the
    # column its first query's window reaches: (start, end, columns read) each.
    n, num_blocks = 300, 80
    gen = torch.Generator().manual_seed(4)
    cache = torch.zeros((2, num_blocks, BS, KVH, HD), dtype=torch.float64)
    blocks = (torch.randperm(num_blocks - 1, generator=gen)[: n // BS] + 1).to(torch.int32)
    attention = PagedAttention([cache], NH, n // BS, scale=SCALE)
    slots = (blocks[:, None].long() * BS + torch.arange(BS)).reshape(-1)  # (T,)
    md = attention.build_metadata(blocks[None, :], slots, [], [], [(0, 0, n)], window)
    assert [(c.start, c.end, c.num_ctx_blocks) for c in md.prefills] == pieces
    q = torch.randn(n, NH, HD, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, n, KVH, HD, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        out = attention.for_step(md)(0, q, k, v)
    for p in (0, 5, 6, 255, 256, 257, 299):
        torch.testing.assert_close(
            out[p], dense(q[p], k, v, p, window), rtol=1e-12, atol=1e-12, msg=f"pos {p}"
        )
