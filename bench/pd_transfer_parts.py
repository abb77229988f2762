"""The pieces bench/pd_transfer_bench.py's transports share: the KV layout and tensors, the
blocks' gather and scatter, timing, child processes; and the memory-copy baseline."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_BLOCKS = (1, 8, 64, 256)
START_TIMEOUT_S = 60.0
READ_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 5.0
# NOTE: a child checks this often whether its parent is gone, so a killed bench leaves
# no server behind.
POLL_MS = 500
# NOTE: Mooncake's tcp transport fails a batch at once (-1, "TCP lane queue-full") past its
# per-peer queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and _MAX_PENDING_ADMISSIONS_PER_PEER,
# 1024 each by default), one entry per segment here: the KV read goes in batches of this many.
TE_SEGMENTS_PER_BATCH = 1024


@dataclass(frozen=True, slots=True)
class KVLayout:
    """One worker's KV cache: ``num_layers`` tensors of (2, num_blocks, block_size,
    num_kv_heads, head_dim) in bf16."""

    num_layers: int = 30
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    num_blocks: int = 512

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_half_block(self) -> int:
        """One block's K (or V) in one layer: the contiguous unit of the layout."""
        return self.block_size * self.num_kv_heads * self.head_dim * 2

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * 2 * self.bytes_per_half_block


def make_kv_cache(layout: KVLayout, seed: int | None) -> list[torch.Tensor]:
    """One KV tensor per layer, random from ``seed`` (the same on every process), zeros
    for ``None``."""
    if seed is None:
        return [
            torch.zeros(layout.layer_shape, dtype=torch.bfloat16) for _ in range(layout.num_layers)
        ]
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(layout.layer_shape, generator=g, dtype=torch.bfloat16)
        for _ in range(layout.num_layers)
    ]


def block_ids(num_blocks: int, n: int, seed: int) -> list[int]:
    """``n`` distinct ids scattered over the pool, as a block table's are."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n].tolist()


def gather_blocks(kv_cache: list[torch.Tensor], ids: torch.Tensor) -> list[torch.Tensor]:
    return [layer.index_select(1, ids) for layer in kv_cache]  # num_layers x (2, n, bs, h, d)


def scatter_blocks(
    kv_cache: list[torch.Tensor], ids: torch.Tensor, blocks: list[torch.Tensor]
) -> None:
    for layer, src in zip(kv_cache, blocks, strict=True):
        layer.index_copy_(1, ids, src)


def same_blocks(got: list[torch.Tensor], got_ids, want: list[torch.Tensor], want_ids) -> bool:
    """Whether blocks ``got_ids`` of one KV cache hold blocks ``want_ids`` of another, byte
    for byte (bf16 compared as int16, so NaN and -0.0 too)."""
    return all(
        torch.equal(g[:, got_ids].view(torch.int16), w[:, want_ids].view(torch.int16))
        for g, w in zip(got, want, strict=True)
    )


def median_s(fn: Callable[[], object], repeats: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn``, ``repeats`` samples after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return samples


def figure(nbytes: int, samples: list[float], **extra: float) -> dict:
    med = statistics.median(samples)
    return {"median_s": med, "gbps": nbytes / med / 1e9, "samples_s": samples, **extra}


def stop_process(proc: mp.process.BaseProcess, timeout: float = STOP_TIMEOUT_S) -> None:
    """Wait for ``proc`` to exit, then terminate it, then kill it; each wait bounded."""
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout)


def orphaned(parent_pid: int) -> bool:
    return os.getppid() != parent_pid


# ---------------------------------------------------------------- memcpy (one process)


def bench_memcpy(layout: KVLayout, n: int, repeats: int, warmup: int) -> dict:
    nbytes = n * layout.bytes_per_block
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    src_np, dst_np = src.numpy(), np.empty(nbytes, dtype=np.uint8)
    kv_src, kv_dst = make_kv_cache(layout, seed=0), make_kv_cache(layout, seed=None)
    src_ids = torch.tensor(block_ids(layout.num_blocks, n, seed=1))
    dst_ids = torch.tensor(block_ids(layout.num_blocks, n, seed=2))
    out = {
        "torch_copy": figure(nbytes, median_s(lambda: dst.copy_(src), repeats, warmup)),
        "numpy_copyto": figure(
            nbytes, median_s(lambda: np.copyto(dst_np, src_np), repeats, warmup)
        ),
        "gather_scatter": figure(
            nbytes,
            median_s(
                lambda: scatter_blocks(kv_dst, dst_ids, gather_blocks(kv_src, src_ids)),
                repeats,
                warmup,
            ),
        ),
    }
    assert torch.equal(dst, src) and np.array_equal(dst_np, src_np)
    assert same_blocks(kv_dst, dst_ids, kv_src, src_ids)
    return out
