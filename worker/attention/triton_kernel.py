"""The Triton kernel behind paged attention on CUDA (``worker.attention.triton_paged``):
queries meet their keys block by block through the block table, where the torch path
gathers every block a step reads into a workspace and runs SDPA over the copy.

One kernel serves decode rows and prefill chunks. A program takes one *tile* of a
request's consecutive queries and one kv head: the query heads of that kv head and the
tile's queries make the rows of its score matrix (GQA without copies), and it walks the
request's keys ``TILE_N`` at a time from the first key any of its queries may read to
the last query's own position, with an online softmax (vLLM's unified Triton attention
is built the same way). A tile is six int32 numbers (``TILE_FIELDS``): the block table
row, the step token of its first query, that query's position, the tile's query count,
the first key position any query reads (a decode row's keys after a shared prefix or
before its window are never read) and the row of its log-sum-exp output.

The query at position p reads key k when key_lo <= k <= p and, with a window W > 0,
k > p - W. Scores and sums are float32; a bfloat16 cache's probabilities are rounded to
bfloat16 before the values' product (as flash attention rounds them), a float32 cache's
products run in IEEE float32 (not TF32). An fp8 cache's bytes are turned into values by
their bit fields (exact, subnormals included, the same arithmetic on any device); its K
scale goes into the scores' scale, its V scale onto the output.
"""

from __future__ import annotations

import triton
import triton.language as tl

TILE_FIELDS = 6  # row, token, position, queries, key_lo, lse_row

# The cache's element: the compute dtype itself, or an fp8 format read into it.
KV_NATIVE, KV_E4M3, KV_E5M2 = 0, 1, 2


@triton.jit
def _fp8_value(b, KIND: tl.constexpr):
    """fp8 bytes (uint8) -> their float32 values; the NaN and infinity patterns read as
    finite numbers (the paged write saturates, so the model alone could produce one)."""
    x = b.to(tl.int32)
    sign = x & 0x80
    if KIND == 1:  # e4m3fn: bias 7, 3 mantissa bits, subnormal step 2^-9
        e = (x >> 3) & 15
        m = x & 7
        normal = (sign << 24) | ((e + 120) << 23) | (m << 20)
        tiny = m.to(tl.float32) * 0.001953125
    else:  # e5m2: bias 15, 2 mantissa bits, subnormal step 2^-16
        e = (x >> 2) & 31
        m = x & 3
        normal = (sign << 24) | ((e + 112) << 23) | (m << 21)
        tiny = m.to(tl.float32) * 0.0000152587890625
    tiny = tl.where(sign != 0, -tiny, tiny)
    return tl.where(e == 0, tiny, normal.to(tl.float32, bitcast=True))


@triton.jit
def _load_kv(ptr, offsets, mask, KV_KIND: tl.constexpr):
    """A tile of K or V, zero where masked: the cache's own dtype, or an fp8 cache's values
    in float32 (the caller casts them to the compute dtype, exactly)."""
    if KV_KIND == 0:
        tile = tl.load(ptr + offsets, mask=mask, other=0.0)
    else:
        tile = _fp8_value(tl.load(ptr + offsets, mask=mask, other=0), KV_KIND)
    return tile


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a @ b, float32 sums (IEEE products for float32 operands, not TF32). UPCAST: both
    operands in float32 first, exact for bfloat16 (NOTE: Triton's CPU interpreter
    multiplies bfloat16 operands as their integer bits)."""
    if UPCAST:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b, out_dtype=tl.float32)
    return c


@triton.jit
def paged_attention_kernel(
    q_ptr, stride_qt, stride_qh,  # (T, nh, hd), heads contiguous
    k_ptr, v_ptr,  # each half of the cache: (num_blocks, BS, KVH, HD) contiguous
    out_ptr, stride_ot, stride_oh,  # (T, nh, hd)
    lse_ptr,  # (rows, KVH, GROUP) float32, written when WRITE_LSE
    table_ptr, stride_table,  # (rows, cols) int32
    tiles_ptr,  # (tiles, TILE_FIELDS) int32
    scale_log2,  # q.k scale x K scale x log2(e)
    v_scale,
    window,  # W > 0: the last W positions; 0: every earlier one
    BS: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    KV_KIND: tl.constexpr, WRITE_LSE: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)  # the kv head
    meta = tiles_ptr + tile * 6
    row = tl.load(meta)
    token0 = tl.load(meta + 1)
    pos0 = tl.load(meta + 2)
    n = tl.load(meta + 3)
    key_lo = tl.load(meta + 4)
    lse_row = tl.load(meta + 5)

    # Score rows: query qi of the tile, head g of the kv head's group.
    m = tl.arange(0, BLOCK_M)
    qi = m // GROUP_P
    g = m % GROUP_P
    valid = (qi < n) & (g < GROUP)
    head = h * GROUP + g
    d = tl.arange(0, HD_P)
    dmask = d < HD
    q_offsets = (token0 + qi).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=valid[:, None] & dmask[None, :], other=0.0)
    qpos = pos0 + qi
    # Keys before this stay masked: the window's start for each query (-1: none).
    floor = tl.where(window > 0, qpos - window, -1)

    last = pos0 + n - 1  # the tile's last query reads keys up to its own position
    first = key_lo
    if window > 0:
        first = tl.maximum(key_lo, pos0 - window + 1)
    start = (first // TILE_N) * TILE_N

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HD_P), tl.float32)
    n_off = tl.arange(0, TILE_N)
    for j in range(start, last + 1, TILE_N):
        kp = j + n_off
        kin = (kp >= first) & (kp <= last)
        block = tl.load(table_ptr + row * stride_table + kp // BS, mask=kin, other=0)
        kv_off = ((block.to(tl.int64) * BS + kp % BS) * KVH + h) * HD
        kv_mask = kin[:, None] & dmask[None, :]
        k = _load_kv(k_ptr, kv_off[:, None] + d[None, :], kv_mask, KV_KIND).to(q.dtype)  # (TILE_N, HD_P)
        s = _dot(q, tl.trans(k), UPCAST) * scale_log2  # (BLOCK_M, TILE_N), log2 units
        seen = kin[None, :] & (kp[None, :] <= qpos[:, None]) & (kp[None, :] > floor[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # NOTE: a row that has seen no key yet keeps -inf; exp2 of (-inf) - 0 is 0, never NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_kv(v_ptr, kv_off[:, None] + d[None, :], kv_mask, KV_KIND).to(q.dtype)  # (TILE_N, HD_P)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    denom = tl.where(l_i > 0, l_i, 1.0)
    out = acc / denom[:, None] * v_scale
    o_offsets = (token0 + qi).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dmask[None, :])
    if WRITE_LSE:
        lse = (m_i + tl.log2(denom)) * 0.6931471805599453
        tl.store(lse_ptr + (lse_row * KVH + h) * GROUP + g, lse, mask=valid)
