"""CUDA's paged attention in Triton (worker/attention/triton_kernel.py), run here in Triton's
CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU).

Checked against attention computed densely in float64 from each row's own K/V (no paging
code involved): decode rows with shared-prefix and window offsets and their log-sum-exp,
prefill chunks causal and within windows that start mid-sequence and span several query
tiles, at head sizes and groups that are not powers of two, a block size that is not one,
float32, bfloat16 and both fp8 caches with scales; through PagedAttention against the
gather-and-SDPA path; bad calls refused before anything is written. On a CUDA host the
``cuda``-marked test runs the compiled kernels against the gather path on the device.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from worker.attention import kernels, triton_paged
from worker.attention.kv_quant import KVScales
from worker.attention.paged_attention import PagedAttention

interpreted = pytest.mark.skipif(not triton_paged.interpreting(), reason="Triton's interpreter is off (a CUDA host runs the cuda test)")

# (cache dtype, compute dtype, K and V scales)
DTYPES = [(torch.float32, torch.float32, (1.0, 1.0)), (torch.bfloat16, torch.bfloat16, (1.0, 1.0)),
          (torch.float8_e4m3fn, torch.bfloat16, (0.37, 2.5)), (torch.float8_e5m2, torch.float32, (1.7, 0.2))]
DTYPE_IDS = [f"{c}-{d}".replace("torch.", "") for c, d, _ in DTYPES]


def close(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: float32 sums; bfloat16: probabilities and the output rounded to bfloat16."""
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=2e-5)
    else:
        torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def dense(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, lo: int, end: int, scale: float, kv_scales=(1.0, 1.0)):
    """q (nh, hd) over keys [lo, end) of k, v (n, kvh, hd), float64 -> out (nh, hd), lse (nh,)."""
    nh, kvh = q.shape[0], k.shape[1]
    out, lse = torch.empty(q.shape, dtype=torch.float64), torch.empty(nh, dtype=torch.float64)
    for h in range(nh):
        s = k[lo:end, h // (nh // kvh)].double() @ q[h].double() * scale * kv_scales[0]
        out[h] = torch.softmax(s, 0) @ v[lo:end, h // (nh // kvh)].double() * kv_scales[1]
        lse[h] = torch.logsumexp(s, 0)
    return out, lse


# (num_heads, kv heads, head_dim, block_size): one query per kv head, SmolLM2's group of 3
# at 64, a head size and a block size that are not powers of two, a group of 8.
DECODE_SHAPES = [(4, 4, 32, 16), (9, 3, 64, 16), (10, 2, 40, 6), (8, 1, 16, 32)]


@interpreted
@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_decode_rows_attend_as_dense_attention_does(shape, dtypes):
    cache_dtype, dtype, kv_scales = dtypes
    nh, kvh, hd, bs = shape
    gen = torch.Generator().manual_seed(sum(shape))
    cache = (torch.randn(2, 40, bs, kvh, hd, generator=gen) * torch.rand(1, 1, bs, 1, 1, generator=gen) ** 3).to(cache_dtype)
    table = torch.randint(0, 40, (5, 12), generator=gen, dtype=torch.int32)
    # Per row: table row, first column, keys from that column on, leading keys skipped.
    rows = [(0, 0, 1, 0), (3, 2, 2 * bs + 3, 0), (4, 1, 5 * bs, bs - 1), (2, 0, 7 * bs + 1, 3), (3, 4, bs, 0)]
    table_row, first_col, num_keys, lead = (np.array(c, dtype=np.int64) for c in zip(*rows, strict=True))
    q = (torch.randn(len(rows), nh, hd, generator=gen) * 3).to(dtype)
    out, lse = torch.full_like(q, float("nan")), torch.full((len(rows), kvh, nh // kvh), float("nan"))
    triton_paged.load_decode(tile_n=16)(q, cache, table, table_row, first_col, num_keys, lead, 0.37, out, lse, kv_scales)
    for i, (r, c, n, ld) in enumerate(rows):
        blocks = table[r, c : c + -(-n // bs)].long()
        k, v = (cache[j, blocks].reshape(-1, kvh, hd) for j in (0, 1))
        want, want_lse = dense(k, v, q[i], ld, n, 0.37, kv_scales)
        close(out[i], want, dtype)
        torch.testing.assert_close(lse[i].reshape(-1).double(), want_lse, rtol=1e-5, atol=1e-5)


# (seq, num_computed, n): from the start over several query tiles, mid-sequence, one query.
CHUNKS = [(0, 0, 37), (1, 29, 9), (2, 20, 1)]


@interpreted
@pytest.mark.parametrize("window", [0, 11])
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (6, 2, 40, 6)])
@pytest.mark.parametrize("dtypes", DTYPES[:3], ids=DTYPE_IDS[:3])
def test_prefill_chunks_attend_causally_as_dense_attention_does(window, shape, dtypes):
    cache_dtype, dtype, kv_scales = dtypes
    nh, kvh, hd, bs = shape
    gen = torch.Generator().manual_seed(hd + window)
    length = max(c + n for _, c, n in CHUNKS)
    k = torch.randn(len(CHUNKS), length, kvh, hd, generator=gen).to(cache_dtype)
    v = torch.randn(len(CHUNKS), length, kvh, hd, generator=gen).to(cache_dtype)
    free = list(range(60))
    random.Random(window).shuffle(free)  # scattered block ids
    cols = -(-length // bs)
    table = torch.tensor([[free.pop() for _ in range(cols)] for _ in CHUNKS], dtype=torch.int32)
    cache = torch.zeros(2, 60, bs, kvh, hd, dtype=cache_dtype)
    for s in range(len(CHUNKS)):
        cache[0, table[s].long()] = torch.cat([k[s], torch.zeros(cols * bs - length, kvh, hd, dtype=cache_dtype)]).view(cols, bs, kvh, hd)
        cache[1, table[s].long()] = torch.cat([v[s], torch.zeros(cols * bs - length, kvh, hd, dtype=cache_dtype)]).view(cols, bs, kvh, hd)
    total = sum(n for *_, n in CHUNKS)
    q = torch.randn(total + 2, nh, hd, generator=gen).to(dtype)  # two tokens before the chunks (a step's decodes)
    out = torch.full_like(q, float("nan"))
    rows, first, n = (np.array(c, dtype=np.int64) for c in zip(*CHUNKS, strict=True))
    offset = 2 + np.concatenate(([0], np.cumsum(n)[:-1]))
    triton_paged.load_prefill(block_q=8, tile_n=16)(q, cache, table, rows, first, n, offset, window, 0.21, out, kv_scales)
    for (s, c, m), o in zip(CHUNKS, offset.tolist(), strict=True):
        for i in range(m):
            pos = c + i
            lo = max(0, pos - window + 1) if window else 0
            close(out[o + i], dense(k[s], v[s], q[o + i], lo, pos + 1, 0.21, kv_scales)[0], dtype)
    assert out[:2].isnan().all()  # tokens of no chunk are left as they were


def step(kernel_choice: str, window: int, cache_dtype: torch.dtype, device: str = "cpu"):
    """One layer of a step with decode rows and prefill chunks through PagedAttention."""
    bs, kvh, nh, hd = 4, 2, 6, 32
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    cache = torch.randn(2, 64, bs, kvh, hd, generator=gen).to(cache_dtype)
    table = torch.arange(64, dtype=torch.int32)[torch.randperm(64, generator=gen)].reshape(4, 16).contiguous()
    decodes = [(0, 18), (1, 9)]  # (row, context)
    prefills = [(2, 6, 13), (3, 0, 5)]  # (row, computed, n)
    where = [(r, c - 1) for r, c in decodes] + [(r, p) for r, c, n in prefills for p in range(c, c + n)]
    slots = torch.tensor([table[r, p // bs].item() * bs + p % bs for r, p in where])
    q, k, v = (torch.randn(len(where), h, hd, generator=gen).to(dtype).to(device) for h in (nh, kvh, kvh))
    cache, table, slots = cache.to(device), table.to(device), slots.to(device)
    extra = {"compute_dtype": dtype, "kv_scales": [KVScales(0.5, 2.0)]} if cache_dtype != dtype else {}
    pa = PagedAttention([cache], nh, 16, kernels=kernel_choice, **extra)
    md = pa.build_metadata(table, slots, [r for r, _ in decodes], [c for _, c in decodes], prefills, sliding_window=window)
    return pa.for_step(md)(0, q, k, v), pa


@interpreted
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_paged_attention_through_triton_equals_the_gather_path(window, cache_dtype):
    out, pa = step("triton", window, cache_dtype)
    want, gather = step("none", window, cache_dtype)
    assert isinstance(pa.decode_kernel, triton_paged.TritonDecode) and isinstance(pa.prefill_kernel, triton_paged.TritonPrefill)
    assert gather.decode_kernel is None and gather.prefill_kernel is None
    if cache_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:  # the gather path rounds each scaled value to bfloat16 first; the kernel scales after
        torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)


@interpreted
def test_bad_calls_are_refused_and_write_nothing():
    decode, prefill = triton_paged.load_decode(), triton_paged.load_prefill()
    cache = torch.randn(2, 4, 8, 2, 32)
    q = torch.randn(1, 4, 32)
    one = np.ones(1, dtype=np.int64)
    out = torch.full((1, 4, 32), 7.0)
    t = torch.tensor([[0]], dtype=torch.int32)
    with pytest.raises(IndexError, match="outside 0..3"):
        decode(q, cache, torch.tensor([[9]], dtype=torch.int32), one * 0, one * 0, one, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="rows outside the table"):  # row 1 of a 1-row table
        decode(q, cache, t, one, one * 0, one, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="rows outside the table"):  # 9 keys need 2 columns
        decode(q, cache, t, one * 0, one * 0, one * 9, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="at least one key"):
        decode(q, cache, t, one * 0, one * 0, one, one, 1.0, out)
    with pytest.raises(ValueError, match="must share a dtype"):
        decode(q.to(torch.bfloat16), cache, t, one * 0, one * 0, one, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="int32"):
        decode(q, cache, torch.tensor([[0]]), one * 0, one * 0, one, one * 0, 1.0, out)
    with pytest.raises(ValueError, match="run past q"):
        prefill(q, cache, t, one * 0, one * 0, one * 2, one * 0, 0, 1.0, out)
    with pytest.raises(ValueError, match="window"):
        prefill(q, cache, t, one * 0, one * 0, one, one * 0, -1, 1.0, out)
    assert (out == 7.0).all()


def test_kernels_are_chosen_by_device_and_by_name(monkeypatch):
    f32 = (torch.device("cpu"), torch.float32, torch.float32, 32, 2)
    decode, prefill = kernels.in_place_kernels("auto", *f32)
    assert not isinstance(decode, triton_paged.TritonDecode) and not isinstance(prefill, triton_paged.TritonPrefill)
    assert kernels.in_place_kernels("none", *f32) == (None, None)
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels.in_place_kernels("cuda", *f32)
    # On a CPU, Triton only under its interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kernels.in_place_kernels("triton", *f32) == (None, None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    decode, prefill = kernels.in_place_kernels("triton", *f32, prefill=False)
    assert isinstance(decode, triton_paged.TritonDecode) and prefill is None
    # float64 and a bfloat16 cache read as float32 are not the kernel's.
    assert kernels.in_place_kernels("triton", torch.device("cpu"), torch.float64, torch.float64, 32, 2) == (None, None)
    assert kernels.in_place_kernels("triton", torch.device("cpu"), torch.bfloat16, torch.float32, 32, 2) == (None, None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_on_cuda_the_compiled_kernels_equal_the_gather_path(window, cache_dtype):
    out, pa = step("auto", window, cache_dtype, "cuda")
    want, _ = step("none", window, cache_dtype, "cuda")
    assert isinstance(pa.decode_kernel, triton_paged.TritonDecode) and isinstance(pa.prefill_kernel, triton_paged.TritonPrefill)
    if cache_dtype == torch.float32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), want.float(), rtol=3e-2, atol=3e-2)


@interpreted
@pytest.mark.parametrize("dtypes", DTYPES, ids=DTYPE_IDS)
def test_the_start_up_check_passes_a_kernel_that_computes_attention(dtypes):
    cache_dtype, dtype, _ = dtypes
    for kernel in (triton_paged.load_decode(), triton_paged.load_prefill()):
        assert triton_paged.self_check(kernel, cache_dtype, dtype, torch.device("cpu"), 16, 3, 64, 3) is None


@interpreted
def test_the_start_up_check_fails_a_kernel_that_does_not(monkeypatch):
    kernel = triton_paged.load_decode()
    monkeypatch.setattr(kernel, "_launch", lambda *args: None)  # writes nothing
    problem = triton_paged.self_check(kernel, torch.float32, torch.float32, torch.device("cpu"), 16, 2, 32, 2)
    assert problem is not None and problem.startswith("row 0 differs")


def test_on_cuda_a_kernel_that_fails_its_check_is_left_out_with_a_warning(caplog):
    """A kernel that cannot run on the device (here: no CUDA at all, so the check's first
    allocation fails) leaves that part of attention to the gather path."""
    if torch.cuda.is_available():
        pytest.skip("needs a host without CUDA, where any CUDA call fails")
    with caplog.at_level("WARNING", logger=kernels.__name__):
        chosen = kernels.in_place_kernels("auto", torch.device("cuda"), torch.float32, torch.float32, 32, 2, block_size=16, num_kv_heads=2)
    assert chosen == (None, None)
    assert [r.getMessage().split(" kernel fails")[0] for r in caplog.records] == ["the Triton paged decode", "the Triton paged prefill"]
