"""RMSNorm and SiLU-and-multiply in one pass each (``csrc/norm_act.c``, loaded with ctypes,
AVX-512 F/BF16), with the roundings of transformers' model in its dtype; and a bfloat16
model's rotary embedding, with ``worker.models.rope``'s roundings.

torch runs RMSNorm as eight ops and SwiGLU's activation as two, each a dispatch and a pass
over memory: at a decode step's few rows the dispatches are most of their time, at a
prefill's many rows the passes (docs/benchmarks.md, 2026-12-03, issue 25). The rotary
embedding is four ops and two views (docs/benchmarks.md, "2026-12-07, 06:00"). vLLM's CPU
backend fuses them alike (its ``rms_norm`` and ``silu_and_mul`` ops).

The library is built by ``make install`` (``python -m worker.models.norm_act`` rebuilds
it) into an ignored ``csrc/norm_act.so``; without it, or on a CPU without AVX-512, ``load``
returns None and ``worker.models.layers`` keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from worker.cpu import native

SOURCE = Path(__file__).parent / "csrc" / "norm_act.c"
LIBRARY = SOURCE.with_suffix(".so")
ABI = 2  # norm_act_abi() of the source this module calls
# -fopenmp: libgomp.so.1, loaded after torch, is torch's own (one OpenMP thread pool).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
FALLBACK = "RMSNorm and SiLU run as torch ops"  # what runs without the library
DTYPES = (torch.float32, torch.bfloat16)
_P = ctypes.c_void_p
_I64 = ctypes.c_int64


class NormAct:
    """The loaded library. Each op takes what it ``supports`` and returns a new tensor."""

    def __init__(self, lib: ctypes.CDLL):
        self._norm = lib.rms_norm
        self._norm.restype = ctypes.c_int
        self._norm.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _P, ctypes.c_float, _P, _I64, ctypes.c_int]
        self._silu = lib.silu_mul
        self._silu.restype = ctypes.c_int
        self._silu.argtypes = [ctypes.c_int, _P, _I64, _I64, _I64, _P, _I64, ctypes.c_int]
        self._rope = lib.rope_bf16
        self._rope.restype = ctypes.c_int
        self._rope.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _P, ctypes.c_int]

    @property
    def addresses(self) -> tuple[int, int, int]:
        """The entry points of rms_norm, silu_mul and rope_bf16, for native callers
        (``worker.step.fused_step``)."""
        return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (self._norm, self._silu, self._rope))

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
        """x (..., D) float32 or bfloat16 on the CPU with contiguous rows (and ``weight``
        (D,) contiguous, of its dtype)."""
        if x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() < 1 or x.shape[-1] < 1 or x.stride(-1) != 1:
            return False
        if x.dim() > 2 and not x.is_contiguous():
            return False
        return weight is None or (weight.dtype == x.dtype and weight.is_contiguous() and weight.shape == x.shape[-1:])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``layers.rms_norm``: x (..., D) normalised in float32, rounded to x's dtype, times weight (D,)."""
        d = x.shape[-1]
        # NOTE: a 2-D x (every call of the decoder's) skips the reshape and the view back,
        # whose cost per call a decode step's many calls add up (docs/benchmarks.md,
        # "Figures moved from docstrings (2026-12-07)").
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, d)
        y = torch.empty_like(x2, memory_format=torch.contiguous_format)
        rc = self._norm(x.dtype == torch.bfloat16, x2.data_ptr(), x2.stride(0), x2.shape[0], d, weight.data_ptr(), eps,
                        y.data_ptr(), d, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rms_norm: the library refused x {tuple(x.shape)} (rc {rc})")
        return y if flat else y.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of gate_up (T, 2I) (gate, then up), rounded as two ops in its
        dtype would round; into ``out`` (T, I) contiguous rows when given."""
        t, two_i = gate_up.shape
        inter = two_i // 2
        if out is None:
            out = torch.empty((t, inter), dtype=gate_up.dtype)
        elif out.shape != (t, inter) or out.dtype != gate_up.dtype or out.stride(-1) != 1:
            raise ValueError(f"silu_mul: out {tuple(out.shape)} {out.dtype} for gate_up {tuple(gate_up.shape)} {gate_up.dtype}")
        rc = self._silu(gate_up.dtype == torch.bfloat16, gate_up.data_ptr(), gate_up.stride(0), t, inter, out.data_ptr(),
                        out.stride(0), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"silu_mul: the library refused gate_up {tuple(gate_up.shape)} (rc {rc})")
        return out

    @staticmethod
    def supports_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """x (T, heads, hd) bfloat16 on the CPU, heads contiguous (rows may be apart), cos
        and sin (T, 1, hd/2) bfloat16 contiguous."""
        if x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            return False
        want = (x.shape[0], 1, x.shape[2] // 2)
        return all(t.dtype == torch.bfloat16 and t.is_contiguous() and tuple(t.shape) == want for t in (cos, sin))

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``rope.apply_rope`` of a bfloat16 x (T, heads, hd): a new contiguous (T, heads, hd)."""
        t, heads, hd = x.shape
        y = torch.empty((t, heads, hd), dtype=x.dtype)
        rc = self._rope(x.data_ptr(), x.stride(0), t, heads, hd, cos.data_ptr(), sin.data_ptr(), y.data_ptr(), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rope: the library refused x {tuple(x.shape)} (rc {rc})")
        return y


@functools.cache
def load() -> NormAct | None:
    """The ops, or None (logged once at debug level) when the library is unavailable or
    this CPU lacks the instructions it was built for."""
    return _load(LIBRARY)


def _load(path: Path) -> NormAct | None:
    lib = native.load(path, "norm_act_abi", ABI, FALLBACK, "norm_act_available")
    return None if lib is None else NormAct(lib)


if __name__ == "__main__":
    native.build_main(SOURCE, CFLAGS, FALLBACK)
