"""The fused fp8 gather (worker/attention/csrc/fp8_gather.c) against the torch fallback
(index_select, then kv_quant.dequantize): the same bits for every byte of both formats,
into every compute dtype, over a real gather; and the fallback when the library is absent."""

from __future__ import annotations

import logging

import pytest
import torch

from worker.attention import fp8_gather
from worker.attention.kv_quant import dequantize, quantize
from worker.cpu import native

KERNEL = fp8_gather.load()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="fp8 gather library not built (make install builds it)")
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _cache(num_blocks: int = 6, block_elems: int = 512) -> torch.Tensor:
    """Every byte value in every block, each block in its own order."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.arange(block_elems) % 256 for _ in range(num_blocks)]
    return torch.stack([r[torch.randperm(block_elems, generator=g)] for r in rows]).to(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    # NOTE: NaNs compare as NaN: torch's own NaN payloads differ between its vector and
    # scalar loops (vcvtps2ph keeps them, c10::Half's scalar conversion does not).
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a.view(INT[a.dtype])[~nan], b.view(INT[b.dtype])[~nan])


@needs_kernel
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("scale", [1.0, 0.3712, 7.3, 1000.0])
@pytest.mark.parametrize("block_elems", [512, 200])  # 200: the vector loops' scalar tails
def test_gather_equals_the_torch_fallback_bit_for_bit(fp8, compute, scale, block_elems):
    cache = _cache(block_elems=block_elems)
    ids = torch.tensor([4, 1, 1, 5, 0, 4, 2])  # out of order, repeated
    ref = dequantize(cache.index_select(0, ids), fp8, torch.empty(len(ids), cache.shape[1], dtype=compute), scale)
    out = torch.full((len(ids) + 2, cache.shape[1]), 7.0, dtype=compute)  # a workspace larger than the gather
    got = KERNEL(cache, ids, 0, len(ids), fp8, out, scale)
    assert got.data_ptr() == out.data_ptr() and got.shape == ref.shape
    _same_bits(got, ref)
    assert (out[len(ids):] == 7.0).all()  # nothing written past m rows
    # Consecutive blocks read in place (no ids).
    got = KERNEL(cache, None, 2, 3, fp8, out, scale)
    _same_bits(got, dequantize(cache[2:5], fp8, torch.empty(3, cache.shape[1], dtype=compute), scale))


@needs_kernel
def test_threads_split_a_large_gather_the_same(monkeypatch):
    cache = _cache(64, 4096)
    ids = torch.randperm(64)[:40]
    ref = dequantize(cache.index_select(0, ids), FP8[0], torch.empty(40, 4096, dtype=torch.bfloat16), 0.5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    _same_bits(KERNEL(cache, ids, 0, 40, FP8[0], torch.empty(40, 4096, dtype=torch.bfloat16), 0.5), ref)


@needs_kernel
def test_out_of_range_block_ids_raise_and_write_nothing():
    cache, out = _cache(), torch.zeros(2, 512, dtype=torch.float32)
    with pytest.raises(IndexError, match="0..5"):
        KERNEL(cache, torch.tensor([0, 6]), 0, 2, FP8[0], out, 1.0)
    with pytest.raises(IndexError):
        KERNEL(cache, None, 5, 2, FP8[0], out, 1.0)
    assert (out == 0).all()


def test_an_absent_or_stale_library_falls_back_quietly(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG, logger=native.__name__):
        assert fp8_gather._load(tmp_path / "missing.so") is None
        (tmp_path / "bad.so").write_bytes(b"not a library")
        assert fp8_gather._load(tmp_path / "bad.so") is None
    assert [r.levelno for r in caplog.records] == [logging.DEBUG, logging.DEBUG]
    assert "not built" in caplog.records[0].getMessage() and "does not load" in caplog.records[1].getMessage()


def test_the_kernel_is_only_for_cpu_and_16_or_32_bit_compute():
    assert fp8_gather.Fp8Gather.supports(torch.bfloat16, torch.device("cpu"))
    assert not fp8_gather.Fp8Gather.supports(torch.float64, torch.device("cpu"))
    assert not fp8_gather.Fp8Gather.supports(torch.bfloat16, torch.device("cuda"))


@needs_kernel
@pytest.mark.parametrize("fp8", FP8)
def test_paged_attention_reads_the_same_through_either_path(fp8, monkeypatch):
    """PagedAttention's decode and prefill outputs, fused read against torch passes: equal."""
    from worker.attention import block_reader, cache_ops, paged_attention
    from worker.attention.paged_attention import PagedAttention
    from worker.kv.kv_cache import allocate_kv_caches

    bs, kvh, nh, hd, nb = 4, 2, 4, 16, 32
    cache = allocate_kv_caches(1, nb, bs, kvh, hd, fp8, "cpu")[0]
    cache.view(torch.uint8).copy_(torch.randint(0, 256, cache.shape, generator=torch.Generator().manual_seed(1)))
    cache.view(torch.uint8)[...] &= 0xF7  # NOTE: no inf/NaN patterns (bit 3 clear), so the outputs are finite
    table = torch.zeros((4, 8), dtype=torch.int32)
    table[0, :3], table[1, :4], table[2, :2] = torch.tensor([5, 9, 2]), torch.tensor([6, 7, 8, 9]), torch.tensor([30, 1])
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(9, h, hd, generator=g, dtype=torch.bfloat16) for h in (nh, kvh, kvh))
    outs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(block_reader, "load_fp8_gather", lambda: None)
            monkeypatch.setattr(cache_ops, "load_fp8_gather", lambda: None)
        pa = PagedAttention([cache.clone()], nh, 8, compute_dtype=torch.bfloat16, kv_scales=[paged_attention.KVScales(0.37, 2.5)])
        assert (pa.reader.fused is not None) == fused and (pa.writers[0].fused is not None) == fused
        md = pa.build_metadata(table, torch.tensor([10, 14, 7] + [24, 25, 26, 27, 28, 29]), [0, 1, 2], [11, 15, 8], [(3, 0, 6)])
        outs.append(pa.for_step(md)(0, q, k, v))
    assert torch.equal(outs[0], outs[1])


SPECIALS = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-30, -1e-30, 1e-45, 447.9, 448.0,
            -449.0, 480.0, 1e6, -1e6, 57344.0, 60000.0, 2**-9, 2**-10, -1.5 * 2**-9, 2**-6, 2**-6 * 0.999, 2**-16,
            2**-17, 2**-14 * 0.99, 1.0, -1.9999]


@needs_kernel
@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.3712, 7.3])
def test_quantize_write_equals_the_torch_quantize_and_scatter(fp8, dtype, scale):
    """The fused write's bytes = kv_quant.quantize(toward_zero=True) (checked against vLLM's
    CPU kernel in test_kv_quant.py), in the listed slots, nothing else touched."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(4000, generator=g) * 10 ** torch.empty(4000).uniform_(-7, 6, generator=g)
    x = torch.cat([torch.tensor(SPECIALS), wide])[: 4000 // 40 * 40].to(dtype).view(-1, 40)  # specials first
    slots = torch.randperm(x.shape[0] + 7, generator=g)[: x.shape[0]]
    cache = torch.full((x.shape[0] + 7, 40), 0xAB, dtype=torch.uint8)
    KERNEL.quantize_write(x, slots, cache, fp8, scale)
    assert torch.equal(cache[slots], quantize(x, fp8, scale, toward_zero=True).view(torch.uint8))
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert (cache[untouched] == 0xAB).all()
    with pytest.raises(IndexError):
        KERNEL.quantize_write(x[:2], torch.tensor([0, cache.shape[0]]), cache, fp8, scale)
