"""The prefill kernel (``worker.attention.paged_prefill``): every prefill chunk of a step
through one call, reading the blocks where they lie. Checked against attention computed
densely in float64 from the sequences' own K/V (no paging code involved), at the head
shapes and block sizes models use, chunks that start mid-sequence, span several of the
kernel's query tiles or hold one query, sliding windows, and decode rows in the same
step; bfloat16 against the error torch's own bf16 path (gather + SDPA) makes."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import worker.attention.kernels as kernels
from worker.attention.paged_attention import PagedAttention
from worker.attention.paged_prefill import load

KERNEL = load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="paged_prefill library not built or this CPU lacks AVX-512 BF16")

NUM_BLOCKS, MAX_BLOCKS, SCALE = 96, 10, 0.17
# (seq, num_computed, n): a chunk from the start, one mid-sequence, one of a single query,
# a long one (several query tiles at every group size); seq 4 decodes in the same step.
CHUNKS = [(0, 0, 50), (1, 100, 7), (2, 33, 1), (3, 5, 130)]
DECODES = [(4, 61)]  # (seq, position)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int, window: int, group: int) -> torch.Tensor:
    """q (nh, hd) at position ``pos`` over k, v (>= pos + 1, kvh, hd) -> (nh, hd), float64."""
    lo = max(0, pos - window + 1) if window else 0
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        p = torch.softmax(k[lo : pos + 1, h // group].double() @ q[h].double() * SCALE, dim=0)
        out[h] = p @ v[lo : pos + 1, h // group].double()
    return out


def run(dtype: torch.dtype, nh: int, kvh: int, hd: int, bs: int, window: int, kernel: bool, seed: int = 0):
    """One step of CHUNKS and DECODES through PagedAttention: (output, dense reference, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [c[0] for c in CHUNKS + DECODES]
    length = max([c + n for _, c, n in CHUNKS] + [p + 1 for _, p in DECODES])
    k = torch.randn(len(seqs), length, kvh, hd, generator=gen).to(dtype)
    v = torch.randn(len(seqs), length, kvh, hd, generator=gen).to(dtype)
    free = list(range(1, NUM_BLOCKS))
    random.Random(seed).shuffle(free)  # scattered block ids
    blocks = [[free.pop() for _ in range(-(-length // bs))] for _ in seqs]
    cache = torch.zeros(2, NUM_BLOCKS, bs, kvh, hd, dtype=dtype)
    table = torch.zeros(len(seqs), MAX_BLOCKS * 16 // bs + 8, dtype=torch.int32)
    for s in seqs:
        table[s, : len(blocks[s])] = torch.tensor(blocks[s], dtype=torch.int32)
        for p in range(length):  # the K/V already computed (the step's own are rewritten below)
            cache[0, blocks[s][p // bs], p % bs], cache[1, blocks[s][p // bs], p % bs] = k[s, p], v[s, p]
    steps = [(s, c, 1) for s, c in DECODES] + CHUNKS  # decodes first, as the runner lays them out
    where = [(s, p) for s, c, n in steps for p in range(c, c + n)]
    q = torch.randn(len(where), nh, hd, generator=gen).to(dtype)
    slots = torch.tensor([blocks[s][p // bs] * bs + p % bs for s, p in where])
    attention = PagedAttention([cache], nh, table.shape[1], scale=SCALE, prefill_kernel=kernel)
    md = attention.build_metadata(table, slots, [s for s, _ in DECODES], [c + 1 for _, c in DECODES], CHUNKS, window)
    ks = torch.stack([k[s, p] for s, p in where])
    vs = torch.stack([v[s, p] for s, p in where])
    with torch.inference_mode():
        out = attention.forward(0, q, ks, vs, md)
    want = torch.stack([dense(q[i], k[s], v[s], p, window, nh // kvh) for i, (s, p) in enumerate(where)])
    return out, want, md


SHAPES = [(12, 4, 64, 32), (8, 8, 32, 16), (16, 1, 128, 16), (4, 2, 256, 64)]


@needs_kernel
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("nh,kvh,hd,bs", SHAPES)
def test_float32_equals_dense_attention(nh, kvh, hd, bs, window):
    out, want, md = run(torch.float32, nh, kvh, hd, bs, window, kernel=True)
    assert md.prefill_rows is not None and md.prefills == []  # the kernel ran, not the gather
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("nh,kvh,hd,bs", SHAPES)
def test_bfloat16_errs_no_more_than_torchs_bf16_path(nh, kvh, hd, bs, window):
    out, want, md = run(torch.bfloat16, nh, kvh, hd, bs, window, kernel=True)
    assert md.prefill_rows is not None
    torch_out, want_again, md_torch = run(torch.bfloat16, nh, kvh, hd, bs, window, kernel=False)
    assert md_torch.prefill_rows is None and len(md_torch.prefills) == len(CHUNKS)
    assert torch.equal(want, want_again)
    err, torch_err = (out.double() - want).abs(), (torch_out.double() - want).abs()
    # Both round the probabilities and the output to bf16: the same size of error.
    assert err.max() <= 1.25 * torch_err.max() and err.mean() <= 1.1 * torch_err.mean()
    assert err.max() < 0.05


@needs_kernel
def test_the_step_without_the_kernel_takes_the_gather_path_with_the_same_result():
    out, _, md = run(torch.float32, 12, 4, 64, 32, 0, kernel=True)
    gathered, _, md_g = run(torch.float32, 12, 4, 64, 32, 0, kernel=False)
    assert md_g.prefill_rows is None
    torch.testing.assert_close(out, gathered, rtol=1e-5, atol=1e-5)


def test_caches_it_cannot_read_keep_the_gather_path(monkeypatch):
    # fp8 caches, a head size that is not a multiple of 32, float64: never the kernel.
    for dtype, hd, compute in ((torch.float8_e4m3fn, 64, torch.bfloat16), (torch.float32, 16, None), (torch.float64, 64, None)):
        a = PagedAttention([torch.zeros(2, 4, 16, 2, hd, dtype=dtype)], 4, 4, compute_dtype=compute)
        assert a.prefill_kernel is None
    # The library missing: the gather path, nothing else changes.
    monkeypatch.setattr(kernels, "load_paged_prefill", lambda: None)
    assert PagedAttention([torch.zeros(2, 4, 16, 2, 64)], 4, 4).prefill_kernel is None


@needs_kernel
def test_bad_calls_are_refused_and_write_nothing():
    cache = torch.zeros(2, 8, 16, 2, 64)
    q = torch.randn(10, 4, 64)
    table = torch.tensor([[1, 2, 3], [4, 9, 5]], dtype=torch.int32)  # 9: outside the 8 blocks
    out = torch.full_like(q, 7.0)

    def call(rows, first, n, offset, **kw):
        args = dict(q=q, cache=cache, table=table, window=0, scale=0.1, out=out) | kw
        KERNEL(rows=np.array(rows), first=np.array(first), n=np.array(n), offset=np.array(offset), **args)

    with pytest.raises(IndexError, match="outside 0..7"):
        call([1], [10], [10], [0])  # positions 10..19 reach the bad id in column 1
    with pytest.raises(ValueError, match="outside the table"):
        call([0], [40], [10], [0])  # positions past the table's 3 columns of 16
    with pytest.raises(ValueError, match="outside the table"):
        call([2], [0], [4], [0])  # no row 2
    with pytest.raises(ValueError, match="past q"):
        call([0], [0], [8], [4])
    with pytest.raises(ValueError, match="one entry per chunk"):
        call([0, 0], [0], [4], [0])
    with pytest.raises(ValueError, match="share a dtype"):
        call([0], [0], [4], [0], q=q.bfloat16())
    with pytest.raises(ValueError, match="int32"):
        call([0], [0], [4], [0], table=table.long())
    assert (out == 7.0).all()  # no chunk was attended: the first errors are found before any
