"""Paged attention over an fp8 KV cache, on every path: grouped decode, shared-prefix
(cascade) decode, and prefill chunks (gathered and read in place).

The reference is attention computed densely in float64 from the dequantized cache
(``fp8 value * scale``, each row's own block list, no paging code), so the only error
left is the compute dtype's; the step's own K/V reach the cache through the quantizing
write, whose bytes are checked against hand-computed fp8 values. Every test runs twice:
through the fused C read (``worker.attention.fp8_gather``) and through the torch passes.
"""

from __future__ import annotations

import pytest
import torch

from worker.attention import block_reader, cache_ops, fp8_gather
from worker.attention.kv_quant import KVScales, quantize
from worker.attention.paged_attention import PagedAttention
from worker.kv.kv_cache import allocate_kv_caches
from worker.step.block_table import BlockTable

BS, KVH, NH, HD, NUM_BLOCKS = 4, 2, 8, 16, 64

# (blocks, context length) per decode row. Rows 0, 2, 5 share blocks 5, 9, 2; rows 1, 4
# share block 7; rows 6, 7 share 12-14 (consecutive ids: read in place).
ROWS = [
    ([5, 9, 2, 20, 21], 18),
    ([7, 11, 3, 30], 15),
    ([5, 9, 2, 22], 13),
    ([40, 41], 6),
    ([7, 11], 8),
    ([5, 9, 2, 23, 24, 25], 21),
    ([12, 13, 14, 60], 15),
    ([12, 13, 14, 61, 62], 18),
]

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]
COMPUTE = [torch.float32, torch.bfloat16]
# NOTE: bfloat16 holds fp8 * scale to 3 digits and its softmax too; float32 is exact to ~1e-7.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True, params=["fused", "torch"])
def fp8_read(request, monkeypatch):
    """Which fp8 read and write PagedAttention takes: the C kernel, or the torch fallback
    (the library made unavailable)."""
    if request.param == "fused":
        if fp8_gather.load() is None:
            pytest.skip("fp8 gather library not built (make install builds it)")
    else:
        monkeypatch.setattr(block_reader, "load_fp8_gather", lambda: None)
        monkeypatch.setattr(cache_ops, "load_fp8_gather", lambda: None)
    return request.param


def dense(cache: torch.Tensor, scales: KVScales, q: torch.Tensor, blocks: list[int], ctx: int, causal_from: int | None = None) -> torch.Tensor:
    """q (n, nh, hd) over the first ctx tokens of ``blocks``, dequantized, float64 ->
    (n, nh, hd). causal_from: the first query's position (None: every query sees all ctx)."""
    k = cache[0, blocks].double().reshape(-1, KVH, HD)[:ctx] * scales.k  # (ctx, kvh, hd)
    v = cache[1, blocks].double().reshape(-1, KVH, HD)[:ctx] * scales.v
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        seen = ctx if causal_from is None else causal_from + i + 1
        for h in range(NH):
            kv = h // (NH // KVH)
            p = torch.softmax(k[:seen, kv] @ q[i, h].double() / HD**0.5, dim=0)  # (seen,)
            out[i, h] = p @ v[:seen, kv]
    return out


def fp8_cache(fp8: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cache = allocate_kv_caches(1, NUM_BLOCKS, BS, KVH, HD, fp8, "cpu")[0]
    cache.copy_((torch.randn(cache.shape, generator=gen) * 3).to(fp8))
    return cache


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("cascade", [None, 1])
def test_decode_equals_dense_attention_of_the_dequantized_cache(fp8, compute, cascade):
    scales = KVScales(0.37, 1.9)
    cache = fp8_cache(fp8)
    table = BlockTable(len(ROWS), 8, BS, "cpu")
    for i, (blocks, _) in enumerate(ROWS):
        table.add_row(i, blocks)
    table.commit()
    n = len(ROWS)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(n, h, HD, generator=gen).to(compute) for h in (NH, KVH, KVH))
    slots = table.compute_slot_mapping(torch.arange(n), torch.tensor([ctx - 1 for _, ctx in ROWS]))
    attention = PagedAttention([cache], NH, 8, cascade_min_tokens=cascade, compute_dtype=compute, kv_scales=[scales])
    md = attention.build_metadata(table.block_table, slots, list(range(n)), [ctx for _, ctx in ROWS], [])
    assert bool(md.shared_prefixes) == (cascade is not None)
    with torch.inference_mode():
        out = attention.forward(0, q, k, v, md)
    assert out.dtype == compute
    # The step's K/V were quantized into their slots before attention read them.
    flat = cache.view(2, -1, KVH, HD)
    assert torch.equal(flat[0, slots].view(torch.uint8), quantize(k, fp8, scales.k, toward_zero=True).view(torch.uint8))
    assert torch.equal(flat[1, slots].view(torch.uint8), quantize(v, fp8, scales.v, toward_zero=True).view(torch.uint8))
    for i, (blocks, ctx) in enumerate(ROWS):
        ref = dense(cache, scales, q[i : i + 1], blocks, ctx)[0]
        torch.testing.assert_close(out[i].double(), ref, rtol=TOL[compute], atol=TOL[compute], msg=f"row {i}")


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("blocks", [[3, 4, 5], [40, 9, 22]], ids=["in-place", "gathered"])
def test_prefill_equals_dense_causal_attention_of_the_dequantized_cache(fp8, compute, blocks):
    """A 6-token chunk after 5 computed tokens."""
    scales = KVScales(2.5, 0.6)
    cache = fp8_cache(fp8, seed=2)
    table = BlockTable(1, 8, BS, "cpu")
    table.add_row(0, blocks)
    table.commit()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, h, HD, generator=gen).to(compute) for h in (NH, KVH, KVH))
    slots = table.compute_slot_mapping(torch.zeros(6, dtype=torch.long), torch.arange(5, 11))
    attention = PagedAttention([cache], NH, 8, compute_dtype=compute, kv_scales=[scales])
    md = attention.build_metadata(table.block_table, slots, [], [], [(0, 5, 6)])
    assert (md.prefills[0].first_block is not None) == (blocks == [3, 4, 5])
    with torch.inference_mode():
        out = attention.forward(0, q, k, v, md)
    ref = dense(cache, scales, q, blocks, 11, causal_from=5)
    torch.testing.assert_close(out.double(), ref, rtol=TOL[compute], atol=TOL[compute])


def test_an_fp8_cache_needs_the_compute_dtype():
    cache = fp8_cache(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="compute dtype"):
        PagedAttention([cache], NH, 8)
