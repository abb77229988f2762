"""The projections' own CPU GEMM (``csrc/packed_gemm.c``, loaded with ctypes): a float32 or
bfloat16 weight packed once at load into panels of 32 outputs, each read from memory in
order, and multiplied with AVX-512 (``vdpbf16ps`` for bfloat16).

A decode step's few rows make a projection a read of its weight, so its time is the
weight's bytes over the pace at which they stream from memory. oneDNN's matmul reads the
weight well below the pace one core streams memory; this kernel, reading each panel in
order, reaches it. At many rows the product is bound by its multiply-adds and the two are
alike (docs/benchmarks.md, "Figures moved from docstrings (2026-12-07)", and "2026-12-03,
12:45"). vLLM's CPU backend runs its linears on its own oneDNN build.

The library is built by ``make install`` (``python -m worker.models.packed_gemm`` rebuilds
it) into an ignored ``csrc/packed_gemm.so``; without it, or on a CPU without AVX-512 (F,
BF16), ``load`` returns None and the projections stay on oneDNN or ``F.linear``
(``worker.models.gemm``).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker.cpu import native

SOURCE = Path(__file__).parent / "csrc" / "packed_gemm.c"
LIBRARY = SOURCE.with_suffix(".so")
ABI = 1  # packed_gemm_abi() of the source this module calls
# -fopenmp: libgomp.so.1, loaded after torch, is torch's own (one OpenMP thread pool).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
FALLBACK = "projections run on oneDNN or F.linear"  # what runs without the library
PANEL = 32  # outputs per panel (the source's PANEL)
DTYPES = (torch.float32, torch.bfloat16)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class PackedGemm:
    """The loaded library: ``pack`` a weight once, then call with it."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.packed_gemm
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, ctypes.c_int]

    @property
    def address(self) -> int:
        """The entry point's address, for native callers (``worker.step.fused_step``)."""
        return ctypes.cast(self._fn, ctypes.c_void_p).value

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        """Whether ``weight`` (out, in) can be packed: float32 or bfloat16 on the CPU, its
        outputs a multiple of the panel, a bfloat16 one's inputs even."""
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in DTYPES:
            return False
        n, k = weight.shape
        return n > 0 and n % PANEL == 0 and k > 0 and (weight.dtype == torch.float32 or k % 2 == 0)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` (N, K) in panels: (N/32, K/2, 32, 2) for bfloat16, (N/32, K, 32) for float32."""
        n, k = weight.shape
        if weight.dtype == torch.bfloat16:
            return weight.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        return weight.reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()

    @staticmethod
    def unpack(packed: torch.Tensor) -> torch.Tensor:
        """The (N, K) weight ``pack`` made ``packed`` from."""
        if packed.dim() == 4:
            p, k2, _, _ = packed.shape
            return packed.permute(0, 2, 1, 3).reshape(p * PANEL, k2 * 2)
        p, k, _ = packed.shape
        return packed.permute(0, 2, 1).reshape(p * PANEL, k)

    @staticmethod
    def shape(packed: torch.Tensor) -> tuple[int, int]:
        """(N, K) of the weight behind ``packed``."""
        return packed.shape[0] * PANEL, packed.shape[1] * (2 if packed.dim() == 4 else 1)

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (..., K) @ W.T + bias, in x's dtype (the weight's); bias (N,) or None."""
        n, k = self.shape(packed)
        if x.dtype != packed.dtype or x.shape[-1] != k:
            raise ValueError(f"packed gemm: x {tuple(x.shape)} {x.dtype} against a ({n}, {k}) {packed.dtype} weight")
        flat = x.dim() == 2  # NOTE: then no reshape and no view back (see norm_act's rms_norm)
        x2 = x if flat else x.reshape(-1, k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.empty((x2.shape[0], n), dtype=x.dtype)
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.numel() != n):
            raise ValueError(f"packed gemm: bias must be ({n},) contiguous {x.dtype}")
        rc = self._fn(x.dtype == torch.bfloat16, x2.data_ptr(), x2.stride(0), x2.shape[0], k, packed.data_ptr(),
                      None if bias is None else bias.data_ptr(), n, y.data_ptr(), n, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"packed gemm: the library refused a ({n}, {k}) weight (rc {rc})")
        return y if flat else y.view(*x.shape[:-1], n)


@functools.cache
def load() -> PackedGemm | None:
    """The kernel, or None (logged once at debug level) when the library is unavailable or
    this CPU lacks the instructions it was built for."""
    return _load(LIBRARY)


def _load(path: Path) -> PackedGemm | None:
    lib = native.load(path, "packed_gemm_abi", ABI, FALLBACK, "packed_gemm_available")
    return None if lib is None else PackedGemm(lib)


if __name__ == "__main__":
    native.build_main(SOURCE, CFLAGS, FALLBACK)
