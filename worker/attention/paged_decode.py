"""Paged decode attention on CPU reading the cache in place (``csrc/paged_decode.c``, loaded
with ctypes): each decode row's queries meet its keys block by block through the block
table, where the torch path gathers the blocks into a workspace and runs SDPA over them.

vLLM's CPU backend does the same with a C++ kernel. The gather costs a copy of every
key and value a step reads, and padding each group of rows to its longest one; the
kernel reads each once and stops at each row's last key. Float32 and bfloat16 caches in
their own dtype, fp8 caches (e4m3fn, e5m2) in either, their values converted as they are
read (an fp8 value is exact in float32; as vLLM's CPU kernel, the queries stay unscaled,
the scale of q.k times the K scale multiplies the scores, and the V scale the output). The output is softmax attention up to rounding (float32 accumulation, as SDPA's
CPU kernel), and the log-sum-exp it returns per query is what cascade attention's merge takes.

The library is built by ``make install`` (``python -m worker.attention.paged_decode``
rebuilds it) into an ignored ``csrc/paged_decode.so``; without it (``worker.cpu.native``)
the torch path runs unchanged. CUDA caches never use it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from worker.cpu import native

SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
LIBRARY = SOURCE.with_suffix(".so")
ABI = 6  # paged_decode_abi() of the source this module calls
# -fopenmp: libgomp.so.1, loaded after torch, is torch's own (one OpenMP thread pool).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

# The cache's element (the kernel's KV_* kinds) and the compute dtypes it takes.
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
_COMPUTE = (torch.float32, torch.bfloat16)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I = ctypes.c_int


class PagedDecode:
    """The loaded library; ``__call__`` is one layer's decode rows."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.paged_decode
        self._fn.restype = _I
        self._fn.argtypes = [_P, _I64, _P, _P, _I, ctypes.c_float, ctypes.c_float, _I64, _I, _I, _I, _I, _P, _I64, _I64,
                             _P, _P, _P, _P, _I64, ctypes.c_float, _I, _P, _P, _I]
        self.max_head_dim = lib.paged_decode_max_head_dim()
        self.max_group = lib.paged_decode_max_group()
        # The entry point's address, for native callers (``worker.step.fused_step``).
        self.address: int = ctypes.cast(self._fn, ctypes.c_void_p).value

    def supports(self, cache_dtype: torch.dtype, dtype: torch.dtype, device: torch.device, head_dim: int, group: int) -> bool:
        """Whether a cache of this dtype, read in this compute dtype, on this device, with
        these heads runs here (a 16/32-bit cache in its own dtype; fp8 into either)."""
        if device.type != "cpu" or cache_dtype not in _KIND or dtype not in _COMPUTE:
            return False
        fits = head_dim <= self.max_head_dim and group <= self.max_group
        return fits and (cache_dtype == dtype or cache_dtype not in _COMPUTE)

    def __call__(self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, rows: np.ndarray, first_col: np.ndarray,
                 nkeys: np.ndarray, lead: np.ndarray, scale: float, out: torch.Tensor, lse: torch.Tensor | None = None,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """out[i] = attention of q[i] (B, nh, hd) over keys [lead[i], nkeys[i]) counted from
        column first_col[i] of table row rows[i] (int64 arrays of B); cache: one layer's
        (2, num_blocks, block_size, kvh, hd), each half contiguous (a cache cut to its first
        blocks, ``kv[:, :n]``, is); table: (rows, cols) int32; out: (B, nh, hd)
        contiguous, q's dtype; lse: (B, kvh, nh // kvh) float32, each query's log-sum-exp, or
        None; kv_scales: an fp8 cache's K and V scales (its values times them)."""
        _, num_blocks, bs, kvh, hd = cache.shape
        B, nh, _ = q.shape
        if not self.supports(cache.dtype, q.dtype, cache.device, hd, nh // kvh) or out.dtype != q.dtype:
            raise ValueError(f"paged decode: q {q.dtype} and out {out.dtype} must share a dtype the {cache.dtype} cache is read in")
        if not cache[0].is_contiguous() or not cache[1].is_contiguous() or not out.is_contiguous():
            raise ValueError("paged decode: the cache's K and V halves and out must each be contiguous")
        if q.stride(2) != 1 or q.stride(1) != hd or tuple(out.shape) != (B, nh, hd):
            raise ValueError(f"paged decode: q {tuple(q.shape)} needs contiguous heads; out {tuple(out.shape)} its shape")
        if table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError(f"paged decode: the block table must be contiguous int32, got {table.dtype}")
        lse_ptr = None
        if lse is not None:
            if lse.dtype != torch.float32 or not lse.is_contiguous() or lse.numel() != B * nh:
                raise ValueError(f"paged decode: lse must be ({B}, {kvh}, {nh // kvh}) contiguous float32")
            lse_ptr = lse.data_ptr()
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (rows, first_col, nkeys, lead)]
        if any(len(a) != B for a in arrays):
            raise ValueError(f"paged decode: rows, first_col, nkeys and lead need {B} entries each")
        rc = self._fn(q.data_ptr(), q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(), _KIND[cache.dtype], *kv_scales,
                      num_blocks, bs, kvh, hd, nh, table.data_ptr(), table.shape[0], table.shape[1],
                      *(a.ctypes.data for a in arrays), B, scale, q.dtype == torch.bfloat16, out.data_ptr(), lse_ptr,
                      torch.get_num_threads())
        if rc == -1:
            raise IndexError(f"paged decode: a block id in the table is outside 0..{num_blocks - 1}")
        if rc != 0:
            raise ValueError(f"paged decode: rows outside the table {tuple(table.shape)}, or heads it cannot take (rc {rc})")


@functools.cache
def load() -> PagedDecode | None:
    """The kernel, or None (logged once at debug level) when the library is unavailable."""
    return _load(LIBRARY)


def _load(path: Path) -> PagedDecode | None:
    lib = native.load(path, "paged_decode_abi", ABI, "decode attention gathers blocks for SDPA", "paged_decode_available")
    return None if lib is None else PagedDecode(lib)


if __name__ == "__main__":
    native.build_main(SOURCE, CFLAGS, "decode attention gathers blocks for SDPA")
