"""The fused fp8 read on CPU: gather the listed blocks' bytes and dequantize them into
the compute-dtype workspace in one pass (``csrc/fp8_gather.c``, loaded with ctypes); and
the paged write's quantize fused with its scatter (float32 and bfloat16 K/V).

The torch fallback (an ``index_select`` of the bytes, then ``kv_quant.dequantize``'s four
elementwise passes) reads and writes the workspace five times; the kernel once. Its bits
are the fallback's (the same float32 multiply, the same rounding; tests compare all 256
bytes of both formats into every compute dtype); the write's bytes are ``kv_quant.quantize``'s
with ``toward_zero`` (vLLM's CPU rounding; the CUDA path never comes here).

The library is built by ``make install`` (``python -m worker.attention.fp8_gather``
rebuilds it) into an ignored ``csrc/fp8_gather.so``; without it (``worker.cpu.native``)
the torch path runs unchanged. CUDA caches never use it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker.cpu import native

SOURCE = Path(__file__).parent / "csrc" / "fp8_gather.c"
LIBRARY = SOURCE.with_suffix(".so")
ABI = 5  # fp8_gather_abi() of the source this module calls
# NOTE: -ffp-contract=off and no -ffast-math: the multiplies must round as torch's do.
# -fopenmp: the library needs libgomp.so.1, which, loaded after torch, is torch's own
# (one OpenMP thread pool in the process).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]

_IN_KIND = {torch.float32: 0, torch.bfloat16: 1}
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# fp8 format -> (mantissa bits, exponent bias)
_FP8 = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}


class Fp8Gather:
    """The loaded library; ``__call__`` is one layer's K or V read."""

    def __init__(self, lib: ctypes.CDLL):
        self._write = lib.fp8_quantize_write
        self._write.restype = ctypes.c_int
        self._write.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                                ctypes.c_float, ctypes.c_int]
        self._fn = lib.fp8_gather_dequant
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_float, ctypes.c_int]

    @staticmethod
    def supports(out_dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and out_dtype in _OUT_KIND

    @staticmethod
    def supports_write(in_dtype: torch.dtype) -> bool:
        return in_dtype in _IN_KIND

    def quantize_write(self, x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, fp8: torch.dtype, scale: float) -> None:
        """cache[slots[t]] = x[t] / scale in ``fp8``, rounded toward zero and saturated (what
        ``kv_quant.quantize(..., toward_zero=True)`` then the scatter give). x: (T, row)
        float32 or bfloat16; cache: (num_slots, row) uint8, contiguous; slots: (T,) int64."""
        T, row = x.shape
        if not x.is_contiguous() or not cache.is_contiguous() or cache.shape[1] != row:
            raise ValueError(f"fp8 write: x {tuple(x.shape)} and cache {tuple(cache.shape)} must be contiguous rows of one size")
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        fp8_mant, fp8_bias = _FP8[fp8]
        rc = self._write(x.data_ptr(), _IN_KIND[x.dtype], T, row, slots.data_ptr(), cache.data_ptr(), cache.shape[0],
                         fp8_mant, fp8_bias, scale, torch.finfo(fp8).max, torch.get_num_threads())
        if rc == -1:
            raise IndexError(f"fp8 write: a slot is outside 0..{cache.shape[0] - 1}")
        if rc != 0:
            raise RuntimeError(f"fp8 write: the kernel returned {rc}")

    def __call__(self, cache: torch.Tensor, block_ids: torch.Tensor | None, first: int, m: int, fp8: torch.dtype,
                 out: torch.Tensor, scale: float) -> torch.Tensor:
        """out[:m] = the fp8 values of ``cache`` (num_blocks, block_elems) uint8 at rows
        ``block_ids`` (int64; None: rows first .. first + m - 1), times ``scale``, in
        out's dtype -- what ``index_select`` then ``kv_quant.dequantize`` give."""
        num_blocks, block_elems = cache.shape
        if not cache.is_contiguous() or out.shape[1] != block_elems or not out.is_contiguous() or out.shape[0] < m:
            raise ValueError(f"fp8 gather: cache {tuple(cache.shape)} and out {tuple(out.shape)} must be contiguous rows of one size")
        ids_ptr = None
        if block_ids is not None:
            if block_ids.dtype != torch.int64 or not block_ids.is_contiguous():
                block_ids = block_ids.to(torch.int64).contiguous()
            ids_ptr = block_ids.data_ptr()
        fp8_mant, fp8_bias = _FP8[fp8]
        # NOTE: e5m2's top exponent is inf/NaN only where the fallback moves it into a
        # dtype with the same exponent field (float16); elsewhere it reads finite.
        top = fp8 == torch.float8_e5m2 and out.dtype == torch.float16
        rc = self._fn(cache.data_ptr(), num_blocks, block_elems, ids_ptr, first, m, out.data_ptr(),
                      _OUT_KIND[out.dtype], fp8_mant, fp8_bias, top, scale, torch.get_num_threads())
        if rc == -1:
            raise IndexError(f"fp8 gather: a block id is outside 0..{num_blocks - 1}")
        if rc != 0:
            raise RuntimeError(f"fp8 gather: the kernel returned {rc}")
        return out[:m]


@functools.cache
def load() -> Fp8Gather | None:
    """The kernel, or None (logged once at debug level) when the library is unavailable."""
    return _load(LIBRARY)


def _load(path: Path) -> Fp8Gather | None:
    lib = native.load(path, "fp8_gather_abi", ABI, "fp8 KV reads use torch")
    return None if lib is None else Fp8Gather(lib)


if __name__ == "__main__":
    native.build_main(SOURCE, CFLAGS, "fp8 KV caches are read through torch")
