"""Worker benchmarks: the paged KV write and paged decode attention, each against the
plain torch operation over the same bytes in the same run (``python -m bench worker``).

* Paged write: K/V of 512 tokens (float32, 8 KV heads x 64 dims) into shuffled slots of
  a 4096-block cache (block size 16), against ``copy_`` of the same bytes into a
  contiguous buffer. Target: at least 70% of copy_'s bandwidth.
* Paged decode: 64 requests x 1,000-token context, GQA 32 query / 8 KV heads, head dim
  64, float32, through a shuffled block table, against SDPA over the same K/V laid
  out contiguously (target: within 2x of SDPA); the default path (the in-place C kernel,
  ``worker.attention.paged_decode``, where it is built) beside the gather-and-SDPA path.
* Prefill attention: a shared-prefix wave (63 requests x 32 new tokens on 256 cached,
  llama50m's heads, bfloat16) through the prefill kernel (``worker.attention.paged_prefill``)
  against the gather and SDPA per chunk. Target: at most half its time.
* fp8 decode: the same decode in bfloat16 (the KV write included) over an fp8 cache
  against a bfloat16 cache, the same batch; the fp8 blocks written and read by the C
  kernels (``worker.attention.fp8_gather``) where they are built. Target: within 1.1x of the
  bfloat16 cache.

Both sides of each comparison run in one torch thread. NOTE: the development machine
has 2 cores shared with other processes; with 2 intra-op threads, an op waits at its
barrier whenever one thread is descheduled, and figures swung 5x between runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.table import Row, best_per_op_us
from worker.attention.cache_ops import KVCacheWriter
from worker.attention.paged_attention import PagedAttention
from worker.kv.kv_cache import allocate_kv_caches
from worker.step.block_table import BlockTable

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 64


def shuffled_table(B: int, blocks_per_seq: int, block_size: int, gen: torch.Generator) -> tuple[BlockTable, torch.Tensor]:
    """B rows of ``blocks_per_seq`` blocks each, the ids 1.. shuffled (no null block): the
    table and its (B, blocks_per_seq) ids."""
    table = BlockTable(B, blocks_per_seq, block_size, "cpu")
    block_ids = (torch.randperm(B * blocks_per_seq, generator=gen) + 1).view(B, blocks_per_seq)
    for i in range(B):
        table.add_row(i, block_ids[i].tolist())
    table.commit()
    return table, block_ids


def warm_up(*fns: Callable[[], object], seconds: float = 1.0) -> None:
    """Run the contenders in turn for a while first.

    NOTE: on the development VM the first passes over freshly mapped memory run 2-5x
    slower (pages being backed, allocator thresholds settling); without this the
    figure measured first is penalised.
    """
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for fn in fns:
            fn()


def best_interleaved_us(*fns: Callable[[], object], rounds: int = 9) -> tuple[float, ...]:
    """Best microseconds per call of each, measured in alternating rounds so that a
    noisy spell on the shared machine hits every side alike."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_per_op_us(fn, repeat=1, min_time_s=0.15))
    return tuple(best)


def write_rows() -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    num_blocks, T = 4096, 512
    cache = allocate_kv_caches(1, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, "cpu")[0]
    key = torch.randn(T, KV_HEADS, HEAD_DIM, generator=gen)  # (T, kvh, hd)
    value = torch.randn(T, KV_HEADS, HEAD_DIM, generator=gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:T]  # (T,) shuffled
    dst = torch.empty(2, T, KV_HEADS, HEAD_DIM)

    def plain_copy() -> None:
        dst[0].copy_(key)
        dst[1].copy_(value)

    writer = KVCacheWriter(cache)

    def paged_write() -> None:
        writer.write(key, value, slots)

    paged_write()
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    assert torch.equal(flat[0][slots], key) and torch.equal(flat[1][slots], value)
    nbytes = 2 * key.numel() * key.element_size()
    warm_up(plain_copy, paged_write)
    copy_us, paged_us = best_interleaved_us(plain_copy, paged_write)
    copy_gbs, paged_gbs = nbytes / copy_us / 1e3, nbytes / paged_us / 1e3
    ratio = paged_gbs / copy_gbs
    return [
        Row("worker: copy_ of 512 tokens' K/V (1 thread)", copy_gbs, "GB/s"),
        Row("worker: paged KV write, 512 tokens", paged_gbs, "GB/s", "≥ 70% of copy_", ratio >= 0.7),
        Row("worker: paged write / copy_", ratio, "x"),
    ]


def decode_rows() -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    B, ctx, num_heads = 64, 1000, 32
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = B * blocks_per_seq + 1
    cache = allocate_kv_caches(1, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32, "cpu")[0]
    cache.normal_(generator=gen)
    table, block_ids = shuffled_table(B, blocks_per_seq, BLOCK_SIZE, gen)
    q = torch.randn(B, num_heads, HEAD_DIM, generator=gen)  # (B, nh, hd): one decode token each
    k_new = cache[0, block_ids[:, -1], (ctx - 1) % BLOCK_SIZE].clone()  # (B, kvh, hd): rewrite what is there
    v_new = cache[1, block_ids[:, -1], (ctx - 1) % BLOCK_SIZE].clone()
    attention = PagedAttention([cache], num_heads, blocks_per_seq)
    gathering = PagedAttention([cache], num_heads, blocks_per_seq, decode_kernel=False)
    rows = torch.arange(B)
    positions = torch.full((B,), ctx - 1)
    slots = table.compute_slot_mapping(rows, positions)
    md = attention.build_metadata(table.block_table, slots, list(range(B)), [ctx] * B, [])
    md_gather = gathering.build_metadata(table.block_table, slots, list(range(B)), [ctx] * B, [])

    # The same K/V, contiguous: (B, kvh, ctx, hd).
    gathered = cache[:, block_ids].reshape(2, B, blocks_per_seq * BLOCK_SIZE, KV_HEADS, HEAD_DIM)[:, :, :ctx]
    k_contig = gathered[0].transpose(1, 2).contiguous()
    v_contig = gathered[1].transpose(1, 2).contiguous()
    del gathered
    q4 = q.unsqueeze(2)  # (B, nh, 1, hd)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k_contig, v_contig, enable_gqa=True)  # (B, nh, 1, hd)

    def paged() -> torch.Tensor:
        return attention.forward(0, q, k_new, v_new, md)  # (B, nh, hd)

    def gather() -> torch.Tensor:
        return gathering.forward(0, q, k_new, v_new, md_gather)

    with torch.inference_mode():
        torch.testing.assert_close(paged(), sdpa()[:, :, 0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gather(), sdpa()[:, :, 0], rtol=1e-4, atol=1e-4)
        warm_up(sdpa, paged, gather, seconds=3.0)
        sdpa_us, paged_us, gather_us = best_interleaved_us(sdpa, paged, gather, rounds=5)
    sdpa_ms, paged_ms, gather_ms = sdpa_us / 1e3, paged_us / 1e3, gather_us / 1e3
    ratio = paged_ms / sdpa_ms
    kernel = "in-place kernel" if attention.decode_kernel is not None else "kernel not built: gather + SDPA"
    return [
        Row("worker: SDPA decode, 64 x 1000 ctx, contiguous (1 thread)", sdpa_ms, "ms"),
        Row(f"worker: paged decode, 64 x 1000 ctx ({kernel})", paged_ms, "ms", "≤ 2× SDPA", ratio <= 2.0),
        Row("worker: paged decode / SDPA", ratio, "x"),
        Row("worker: paged decode, gather + SDPA path", gather_ms, "ms"),
    ]


def _bf16_decode(kv_dtype: torch.dtype, B: int, ctx: int, num_heads: int) -> Callable[[], torch.Tensor]:
    """One layer's decode step (paged write, then attention) of B requests at ``ctx``, in
    bfloat16, over a cache of ``kv_dtype``; the same values and block tables for any dtype."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = B * blocks_per_seq + 1
    cache = allocate_kv_caches(1, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, kv_dtype, "cpu")[0]
    cache.copy_(torch.randn(cache.shape, generator=gen))
    table, block_ids = shuffled_table(B, blocks_per_seq, BLOCK_SIZE, gen)
    q = torch.randn(B, num_heads, HEAD_DIM, generator=gen).bfloat16()  # (B, nh, hd)
    k_new = torch.randn(B, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()  # (B, kvh, hd)
    v_new = torch.randn(B, KV_HEADS, HEAD_DIM, generator=gen).bfloat16()
    attention = PagedAttention([cache], num_heads, blocks_per_seq, compute_dtype=torch.bfloat16)
    slots = table.compute_slot_mapping(torch.arange(B), torch.full((B,), ctx - 1))
    md = attention.build_metadata(table.block_table, slots, list(range(B)), [ctx] * B, [])
    return lambda: attention.forward(0, q, k_new, v_new, md)


def fp8_decode_rows() -> list[Row]:
    B, ctx, num_heads = 64, 1000, 32
    bf16 = _bf16_decode(torch.bfloat16, B, ctx, num_heads)
    fp8 = _bf16_decode(torch.float8_e4m3fn, B, ctx, num_heads)
    with torch.inference_mode():
        warm_up(bf16, fp8, seconds=3.0)
        bf16_us, fp8_us = best_interleaved_us(bf16, fp8, rounds=5)
    ratio = fp8_us / bf16_us
    return [
        Row("worker: bf16 decode, bf16 KV cache, 64 x 1000 ctx (1 thread)", bf16_us / 1e3, "ms"),
        Row("worker: bf16 decode, fp8 KV cache, 64 x 1000 ctx", fp8_us / 1e3, "ms"),
        Row("worker: fp8 / bf16 KV cache decode", ratio, "x", "≤ 1.1×", ratio <= 1.1),
    ]


def prefill_rows() -> list[Row]:
    """A shared-prefix wave's prefill attention, one layer of llama50m's shape (12 query /
    4 KV heads of 64, bfloat16, blocks of 32): 63 requests of 32 new tokens after 256
    cached ones, through shuffled block tables, the kernel against the gather and SDPA
    per chunk it replaced."""
    gen = torch.Generator().manual_seed(0)
    B, cached, n, num_heads, kvh, hd, bs = 63, 256, 32, 12, 4, 64, 32
    blocks_per_seq = -(-(cached + n) // bs)
    num_blocks = B * blocks_per_seq + 1
    cache = allocate_kv_caches(1, num_blocks, bs, kvh, hd, torch.bfloat16, "cpu")[0]
    cache.copy_(torch.randn(cache.shape, generator=gen))
    table, block_ids = shuffled_table(B, blocks_per_seq, bs, gen)
    q = torch.randn(B * n, num_heads, hd, generator=gen).bfloat16()
    k_new = torch.randn(B * n, kvh, hd, generator=gen).bfloat16()
    v_new = torch.randn(B * n, kvh, hd, generator=gen).bfloat16()
    slots = table.compute_slot_mapping(torch.arange(B).repeat_interleave(n), torch.arange(cached, cached + n).repeat(B))
    chunks = [(i, cached, n) for i in range(B)]
    kernel = PagedAttention([cache], num_heads, blocks_per_seq)
    gathering = PagedAttention([cache], num_heads, blocks_per_seq, prefill_kernel=False)
    md = kernel.build_metadata(table.block_table, slots, [], [], chunks)
    md_gather = gathering.build_metadata(table.block_table, slots, [], [], chunks)

    def paged() -> torch.Tensor:
        return kernel.forward(0, q, k_new, v_new, md)

    def gather() -> torch.Tensor:
        return gathering.forward(0, q, k_new, v_new, md_gather)

    with torch.inference_mode():
        torch.testing.assert_close(paged(), gather(), rtol=2e-2, atol=2e-2)
        warm_up(paged, gather, seconds=3.0)
        paged_us, gather_us = best_interleaved_us(paged, gather, rounds=5)
    ratio = paged_us / gather_us
    how = "in-place kernel" if kernel.prefill_kernel is not None else "kernel not built: gather + SDPA"
    return [
        Row("worker: bf16 prefill, 63 x 32 new on 256 cached, gather + SDPA per chunk (1 thread)", gather_us / 1e3, "ms"),
        Row(f"worker: bf16 prefill, the same ({how})", paged_us / 1e3, "ms"),
        Row("worker: prefill kernel / gather + SDPA", ratio, "x", "≤ 0.5×", ratio <= 0.5),
    ]


def rows() -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return write_rows() + decode_rows() + fp8_decode_rows() + prefill_rows()
    finally:
        torch.set_num_threads(threads)
