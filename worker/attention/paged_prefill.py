"""Paged prefill attention on CPU reading the cache in place (``csrc/paged_prefill.c``,
loaded with ctypes): every prefill chunk of a step in one call, each chunk's queries
meeting its keys block by block through the block table, causal (and within a sliding
window), where the torch path gathers each chunk's blocks and runs SDPA once per chunk.

At the tens of queries each request of a shared-prefix batch prefills, SDPA's CPU
kernel spent most of its time outside its products (docs/benchmarks.md, "Figures moved
from docstrings (2026-12-07)"). Float32 and bfloat16 caches read in their own dtype on
AVX-512 (F, BF16); bfloat16 rounded where torch's CPU flash attention rounds
(the probabilities before the values' product, the output once), float32 sums.

The library is built by ``make install`` (``python -m worker.attention.paged_prefill``
rebuilds it) into an ignored ``csrc/paged_prefill.so``; without it (``worker.cpu.native``)
the torch path runs unchanged. fp8 caches and CUDA never use it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from worker.cpu import native

SOURCE = Path(__file__).parent / "csrc" / "paged_prefill.c"
LIBRARY = SOURCE.with_suffix(".so")
ABI = 1  # paged_prefill_abi() of the source this module calls
# -fopenmp: libgomp.so.1, loaded after torch, is torch's own (one OpenMP thread pool).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
FALLBACK = "prefill attention gathers blocks for SDPA"

_DTYPES = (torch.float32, torch.bfloat16)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int


class PagedPrefill:
    """The loaded library; ``__call__`` is one layer's prefill chunks."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.paged_prefill
        self._fn.restype = _I
        self._fn.argtypes = [_I, _P, _I64, _P, _P, _I64, _I, _I, _I, _I, _P, _I64, _I64, _P, _P, _P, _P, _I64, _I64,
                             ctypes.c_float, _P, _I64, _I]
        self.max_head_dim = lib.paged_prefill_max_head_dim()
        self.max_group = lib.paged_prefill_max_group()
        # The entry point's address, for native callers (``worker.step.fused_step``).
        self.address: int = ctypes.cast(self._fn, ctypes.c_void_p).value

    def supports(self, cache_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> bool:
        """Whether a cache of this dtype, read in this compute dtype, on this device, with
        these heads runs here (float32 or bfloat16, the cache's own; heads of 32k elements)."""
        return (device.type == "cpu" and cache_dtype in _DTYPES and dtype == cache_dtype and head_dim % 32 == 0
                and head_dim <= self.max_head_dim and 1 <= group <= self.max_group)

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, rows: np.ndarray, first: np.ndarray,
                 n: np.ndarray, offset: np.ndarray, window: int, scale: float, out: torch.Tensor,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """out[offset[c]:offset[c] + n[c]] = causal attention of the same tokens of q (T, nh,
        hd), at positions [first[c], first[c] + n[c]), over the keys of table row rows[c]
        (and only the last ``window`` positions when window > 0); int64 arrays of one entry
        per chunk. cache: one layer's (2, num_blocks, block_size, kvh, hd), each half
        contiguous; table: (rows, cols) int32; out: q's shape and dtype, heads contiguous.
        kv_scales: an fp8 cache's (the Triton kernel's call); this one reads none, so 1.0."""
        _, num_blocks, bs, kvh, hd = cache.shape
        T, nh, _ = q.shape
        if not self.supports(cache.dtype, q.dtype, cache.device, hd, nh // kvh) or nh % kvh or out.dtype != q.dtype:
            raise ValueError(f"paged prefill: q {q.dtype}, out {out.dtype} and the {cache.dtype} cache must share a dtype it takes")
        if not cache[0].is_contiguous() or not cache[1].is_contiguous():
            raise ValueError("paged prefill: the cache's K and V halves must each be contiguous")
        if tuple(kv_scales) != (1.0, 1.0):
            raise ValueError(f"paged prefill: K and V scales {tuple(kv_scales)} are an fp8 cache's, which it does not read")
        for name, t in (("q", q), ("out", out)):
            if t.stride(2) != 1 or t.stride(1) != hd or tuple(t.shape) != (T, nh, hd):
                raise ValueError(f"paged prefill: {name} {tuple(t.shape)} needs q's shape and contiguous heads")
        if table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError(f"paged prefill: the block table must be contiguous int32, got {table.dtype}")
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (rows, first, n, offset)]
        if len({len(a) for a in arrays}) != 1:
            raise ValueError("paged prefill: rows, first, n and offset need one entry per chunk each")
        if len(arrays[3]) and int((arrays[3] + arrays[2]).max()) > T:
            raise ValueError(f"paged prefill: a chunk's tokens run past q's {T}")
        rc = self._fn(q.dtype == torch.bfloat16, q.data_ptr(), q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(),
                      num_blocks, bs, kvh, hd, nh, table.data_ptr(), table.shape[0], table.shape[1],
                      *(a.ctypes.data for a in arrays), len(arrays[0]), window, scale, out.data_ptr(), out.stride(0),
                      torch.get_num_threads())
        if rc == -1:
            raise IndexError(f"paged prefill: a block id in the table is outside 0..{num_blocks - 1}")
        if rc == -3:
            raise MemoryError("paged prefill: no memory for its scratch")
        if rc != 0:
            raise ValueError(f"paged prefill: a chunk outside the table {tuple(table.shape)}, or heads it cannot take (rc {rc})")


@functools.cache
def load() -> PagedPrefill | None:
    """The kernel, or None (logged once at debug level) when the library is unavailable."""
    return _load(LIBRARY)


def _load(path: Path) -> PagedPrefill | None:
    lib = native.load(path, "paged_prefill_abi", ABI, FALLBACK, "paged_prefill_available")
    return None if lib is None else PagedPrefill(lib)


if __name__ == "__main__":
    native.build_main(SOURCE, CFLAGS, FALLBACK)
