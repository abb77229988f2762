"""How a model's projections (its matrix products) run: their dtype and their kernel.

**Dtype.** A bfloat16 (float16) model's products run in its dtype where the CPU has a
native GEMM for it (oneDNN's, on AVX-512 BF16 or AMX). Elsewhere torch's bfloat16 matmul is
a slow fallback, far behind float32 on the same cores (oneDNN cannot create a bfloat16
matmul primitive there, and vLLM's CPU backend falls back to the same ``F.linear``), so
the weights are held in float32 (the bfloat16 values, exactly) and each product runs in
float32, rounded to the model's dtype: a bfloat16 GEMM's result up to the order of the
sums, at twice the projection weights' memory.

**Kernel.** Where ``worker.models.packed_gemm`` runs, a projection whose outputs fill its
panels runs there: at decode sizes a projection is a read of its weight, which that kernel
streams faster than oneDNN. Elsewhere a float32 projection runs oneDNN's matmul over a
weight reordered once, at load (as vLLM's CPU backend's ``create_onednn_mm``), since
``F.linear`` repacks the weight on every call; only from ``ONEDNN_MIN_WEIGHT`` elements, as
small weights were slower reordered. A half-precision projection with a native GEMM runs on
its reordered weight at every size (the same bits, faster). The reordered weight replaces
the plain one; where oneDNN is not built in, or refuses the weight, ``F.linear`` stays.

A float32 weight left to ``F.linear`` is held column-major (its storage (in, out)), so the
product runs over contiguous rows of W rather than a transposed operand, which was faster.

Figures: docs/benchmarks.md, "Figures moved from docstrings (2026-12-07)".
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)
# NOTE: between the tiny checkpoint's largest weight (256 x 1536, slower reordered) and
# the 51M Llama's smallest projection (768 x 768, faster).
ONEDNN_MIN_WEIGHT = 1 << 19


def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU has a native GEMM for ``dtype`` (bfloat16 or float16)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.ops.mkldnn._is_mkldnn_fp16_supported()


def gemm_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype the projections of a ``dtype`` model on ``device`` are computed in."""
    if torch.device(device).type != "cpu" or dtype not in HALF_DTYPES or native_half_gemm(dtype):
        return dtype
    return torch.float32


def onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (out, in) on the CPU reordered for oneDNN's matmul, or None where it
    stays plain: a float32 one under ``ONEDNN_MIN_WEIGHT`` elements, a half-precision one
    without a native GEMM, another dtype or device, no oneDNN."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.float32:
        if weight.numel() < ONEDNN_MIN_WEIGHT:
            return None
    elif weight.dtype not in HALF_DTYPES or not native_half_gemm(weight.dtype):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    except (RuntimeError, AttributeError):
        return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) @ weight.T + bias, ``weight`` from ``onednn_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """A float32 CPU weight (out, in) with its storage transposed (see the module); others as they are."""
    return weight.t().contiguous().t() if _cpu_float32_matrix(weight) else weight


def _cpu_float32_matrix(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
