"""The in-place paged decode kernel (worker/attention/csrc/paged_decode.c).

Checked against attention computed densely in float64 from each row's block list (no
paging code involved), on both its code paths (the AVX2 loops take head sizes that are a
multiple of 16, plain C the rest); through PagedAttention against the gather-and-SDPA
path with windows and shared prefixes; and on bad input.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from worker.attention import kernels, paged_attention, paged_decode
from worker.attention.paged_attention import PagedAttention
from worker.cpu import native

KERNEL = paged_decode.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="paged decode library not built (make install builds it)")


def dense(cache: torch.Tensor, q: torch.Tensor, blocks: list[int], first: int, end: int, scale: float, kv_scales=(1.0, 1.0)):
    """q (nh, hd) over keys [first, end) of ``blocks``, in float64 -> out (nh, hd), lse (nh,)."""
    _, _, _, kvh, hd = cache.shape
    nh = q.shape[0]
    k = cache[0, blocks].reshape(-1, kvh, hd)[first:end].double() * kv_scales[0]  # (n, kvh, hd)
    v = cache[1, blocks].reshape(-1, kvh, hd)[first:end].double() * kv_scales[1]
    out, lse = torch.empty(nh, hd, dtype=torch.float64), torch.empty(nh, dtype=torch.float64)
    for h in range(nh):
        s = k[:, h // (nh // kvh)] @ q[h].double() * scale  # (n,)
        out[h], lse[h] = torch.softmax(s, dim=0) @ v[:, h // (nh // kvh)], torch.logsumexp(s, dim=0)
    return out, lse


# (num_heads, kv heads, head_dim, block_size): the AVX2 loops (head_dim % 16 == 0; a bf16
# cache with AVX-512 BF16 and head_dim % 32 == 0: its own loops, 32, 64 and 128) with
# one query per kv head, odd groups and a group of 16; plain C (head_dim 40, 24); blocks
# larger than the kernel's 64-key tile; a row's kv heads over more than one task (its
# buffers hold 4,096 query elements: 2 of 4 heads of 8 x 256, then 2 and 1 of 3 of 16 x 128).
SHAPES = [(8, 2, 32, 32), (12, 4, 64, 16), (4, 4, 128, 128), (6, 2, 64, 8), (16, 1, 32, 4), (10, 2, 40, 16), (3, 1, 24, 8),
          (32, 4, 256, 16), (48, 3, 128, 16)]


# (cache dtype, compute dtype, K and V scales): 16/32-bit caches in their own dtype, fp8
# ones (their values times the scales) in either.
DTYPES = [(torch.float32, torch.float32, (1.0, 1.0)), (torch.bfloat16, torch.bfloat16, (1.0, 1.0)),
          (torch.float8_e4m3fn, torch.bfloat16, (0.37, 2.5)), (torch.float8_e5m2, torch.float32, (1.7, 0.2))]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
def test_each_row_attends_to_its_keys_as_dense_attention_does(shape, dtypes):
    cache_dtype, dtype, kv_scales = dtypes
    nh, kvh, hd, bs = shape
    gen = torch.Generator().manual_seed(sum(shape))
    num_blocks, cols = 48, 12
    # NOTE: normal values (no fp8 NaN patterns), subnormals among an fp8 cache's
    cache = (torch.randn(2, num_blocks, bs, kvh, hd, generator=gen) * torch.rand(1, 1, bs, 1, 1, generator=gen) ** 3).to(cache_dtype)
    table = torch.randint(0, num_blocks, (6, cols), generator=gen, dtype=torch.int32)
    # Per row: table row, first column, keys from that column on, leading keys skipped.
    rows = [(0, 0, 1, 0), (3, 2, 2 * bs + 3, 0), (5, 1, 5 * bs, bs - 1), (2, 0, 7 * bs + 1, 3), (3, 4, bs, 0)]
    table_row, first_col, num_keys, lead = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
    q = (torch.randn(len(rows), nh, hd, generator=gen) * 3).to(dtype)
    out, lse = torch.empty_like(q), torch.empty(len(rows), kvh, nh // kvh)
    scale = 0.37
    KERNEL(q, cache, table, table_row, first_col, num_keys, lead, scale, out, lse, kv_scales)
    for i, (r, c, n, ld) in enumerate(rows):
        blocks = table[r, c : c + -(-n // bs)].long().tolist()
        want, want_lse = dense(cache, q[i], blocks, ld, n, scale, kv_scales)
        if dtype == torch.float32:
            torch.testing.assert_close(out[i].double(), want, rtol=1e-4, atol=2e-5)  # float32 scores of |q.k| up to ~30
        else:  # float32 accumulation, one rounding to bfloat16 at the end
            torch.testing.assert_close(out[i].double(), want.to(dtype).double(), rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(lse[i].reshape(-1).double(), want_lse, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_queries_may_be_a_strided_view():
    """The model's q is a view of its fused projection: rows further apart than nh * hd."""
    nh, kvh, hd, bs = 4, 2, 32, 8
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 16, bs, kvh, hd, generator=gen)
    table = torch.arange(16, dtype=torch.int32).reshape(2, 8)
    qkv = torch.randn(3, (nh + 2 * kvh) * hd, generator=gen)
    q = qkv[:, : nh * hd].view(3, nh, hd)
    args = (np.array([0, 1, 0]), np.zeros(3), np.array([9, 30, 64]), np.zeros(3))
    out, dense_out = torch.empty(3, nh, hd), torch.empty(3, nh, hd)
    KERNEL(q, cache, table, *args, 0.2, out)
    KERNEL(q.contiguous(), cache, table, *args, 0.2, dense_out)
    assert torch.equal(out, dense_out)


@needs_kernel
def test_a_cache_cut_to_its_first_blocks_is_read_where_its_halves_lie():
    """The worker serves ``kv[:, :num_blocks]`` of the cache it allocated (the scheduler may
    take fewer blocks than fit): V starts a whole allocation after K, not num_blocks after."""
    nh, kvh, hd, bs = 4, 2, 32, 8
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2, 24, bs, kvh, hd, generator=gen)
    cut = full[:, :10]
    assert not cut.is_contiguous()
    table = torch.tensor([[9, 0, 4], [3, 7, 1]], dtype=torch.int32)
    q = torch.randn(2, nh, hd, generator=gen)
    args = (np.array([0, 1]), np.zeros(2), np.array([20, 17]), np.zeros(2))
    out, want = torch.empty(2, nh, hd), torch.empty(2, nh, hd)
    KERNEL(q, cut, table, *args, 0.3, out)
    KERNEL(q, cut.contiguous(), table, *args, 0.3, want)
    assert torch.equal(out, want)
    with pytest.raises(IndexError, match="outside 0..9"):  # the cut, not the allocation, bounds the ids
        KERNEL(q[:1], cut, torch.tensor([[12]], dtype=torch.int32), np.zeros(1), np.zeros(1), np.ones(1), np.zeros(1), 0.3, out[:1])


@needs_kernel
def test_bad_input_is_refused_and_writes_nothing():
    nh, kvh, hd, bs = 4, 2, 32, 8
    cache = torch.randn(2, 4, bs, kvh, hd)
    q = torch.randn(1, nh, hd)
    one = np.ones(1, dtype=np.int64)
    out = torch.full((1, nh, hd), 7.0)
    with pytest.raises(IndexError, match="outside 0..3"):
        KERNEL(q, cache, torch.tensor([[9]], dtype=torch.int32), one * 0, one * 0, one, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="rows outside the table"):  # row 1 of a 1-row table
        KERNEL(q, cache, torch.tensor([[0]], dtype=torch.int32), one, one * 0, one, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="rows outside the table"):  # 9 keys need 2 columns
        KERNEL(q, cache, torch.tensor([[0]], dtype=torch.int32), one * 0, one * 0, one * 9, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="must share a dtype"):
        KERNEL(q.to(torch.bfloat16), cache, torch.tensor([[0]], dtype=torch.int32), one * 0, one * 0, one, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="must share a dtype"):  # an fp8 cache is read in float32 or bfloat16
        KERNEL(q.half(), cache.to(torch.float8_e4m3fn), torch.tensor([[0]], dtype=torch.int32), one * 0, one * 0, one, one * 0,
               1.0, out.half())
    with pytest.raises(ValueError, match="int32"):
        KERNEL(q, cache, torch.tensor([[0]]), one * 0, one * 0, one, one * 0, 1.0, out)
    assert (out == 7.0).all()


BS, KVH, NH, HD, NUM_BLOCKS = 4, 2, 6, 32, 64
# (blocks, context) per decode row: rows 0, 2, 4 share blocks 5, 9, 2 (cascade's group).
ROWS = [([5, 9, 2, 20, 21], 18), ([7, 11, 3, 30], 15), ([5, 9, 2, 22], 13), ([40, 41], 6), ([5, 9, 2, 23, 24, 25], 21)]


def decode(window: int = 0, cache_dtype: torch.dtype = torch.float32, **kwargs):
    """One layer's decode tokens through PagedAttention: its output and metadata. An fp8
    cache is read in bfloat16 with K and V scales."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, NUM_BLOCKS, BS, KVH, HD, generator=gen).to(cache_dtype)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    if cache_dtype == torch.float8_e4m3fn:
        kwargs.update(compute_dtype=dtype, kv_scales=[paged_attention.KVScales(0.5, 2.0)])
    table = torch.zeros((len(ROWS), 8), dtype=torch.int32)
    for r, (blocks, _) in enumerate(ROWS):
        table[r, : len(blocks)] = torch.tensor(blocks)
    ctx = [c for _, c in ROWS]
    slots = torch.tensor([table[r, (c - 1) // BS].item() * BS + (c - 1) % BS for r, c in enumerate(ctx)])
    q = torch.randn(len(ROWS), NH, HD, generator=gen).to(dtype)
    k, v = (torch.randn(len(ROWS), KVH, HD, generator=gen).to(dtype) for _ in range(2))
    pa = PagedAttention([cache], NH, 8, **kwargs)
    md = pa.build_metadata(table, slots, list(range(len(ROWS))), ctx, [], sliding_window=window)
    return pa.for_step(md)(0, q, k, v), md


@needs_kernel
@pytest.mark.parametrize("window", [0, 5, 9])
@pytest.mark.parametrize("cascade", ["auto", 1])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_the_kernel_path_equals_the_gather_and_sdpa_path(window, cascade, cache_dtype):
    out, md = decode(window, cache_dtype, cascade_min_tokens=cascade)
    want, md_sdpa = decode(window, cache_dtype, cascade_min_tokens=cascade, decode_kernel=False)
    assert md.decode_rows is not None and not md.decode_groups
    assert md_sdpa.decode_rows is None and md_sdpa.decode_groups
    # shared prefixes: only when asked for (cascade 1) and never within a window
    assert bool(md.shared_prefixes) == (cascade == 1 and window == 0)
    if cache_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    else:  # the gather path rounds each scaled value to bfloat16 before attending; the kernel does not
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


@needs_kernel
def test_auto_cascade_is_off_with_the_kernel_and_on_without():
    assert PagedAttention([torch.zeros(2, 4, BS, KVH, HD)], NH, 8).cascade_min_tokens is None
    plain = PagedAttention([torch.zeros(2, 4, BS, KVH, HD)], NH, 8, decode_kernel=False)
    assert plain.cascade_min_tokens == paged_attention.DEFAULT_CASCADE_MIN_TOKENS
    # float64 has no kernel: the gather path, cascade at its default
    f64 = PagedAttention([torch.zeros(2, 4, BS, KVH, HD, dtype=torch.float64)], NH, 8)
    assert f64.decode_kernel is None and f64.cascade_min_tokens == paged_attention.DEFAULT_CASCADE_MIN_TOKENS


def test_without_the_library_decode_gathers(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(kernels, "load_paged_decode", lambda: None)
    out, md = decode()
    assert md.decode_rows is None and md.decode_groups
    want, _ = decode(decode_kernel=False)
    assert torch.equal(out, want)
    with caplog.at_level(logging.DEBUG, logger=native.__name__):
        assert paged_decode._load(tmp_path / "missing.so") is None
    assert "not built" in caplog.records[0].getMessage()


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("kvh", [3, 4])
def test_one_row_on_several_threads_splits_its_heads_and_attends_alike(threads, kvh):
    """Fewer rows than threads: each row's kv heads go to tasks of their own (3 heads on 2
    threads: 2 and 1), each head's output as dense attention's."""
    gen = torch.Generator().manual_seed(threads * kvh)
    nh, hd, bs, num_blocks = 3 * kvh, 64, 16, 12
    cache = torch.randn(2, num_blocks, bs, kvh, hd, generator=gen).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=gen)[:8].to(torch.int32).view(1, 8).contiguous()
    q = (torch.randn(1, nh, hd, generator=gen) * 3).to(torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(1, kvh, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        KERNEL(q, cache, table, np.array([0]), np.array([0]), np.array([5 * bs + 7]), np.array([0]), 0.125, out, lse)
    finally:
        torch.set_num_threads(before)
    want, want_lse = dense(cache, q[0], table[0, :6].long().tolist(), 0, 5 * bs + 7, 0.125)
    torch.testing.assert_close(out[0].double(), want.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(lse[0].reshape(-1).double(), want_lse, rtol=1e-5, atol=1e-5)
