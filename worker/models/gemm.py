"""How a model's projections (its matrix products) run: their dtype and their kernel.

**Dtype.**
A bfloat16 (or float16) model's products run in its own dtype where the CPU has a native
GEMM for it: oneDNN's, on AVX-512 BF16 or AMX, which torch then calls. Elsewhere (an AVX2
CPU, such as the development machine's AMD EPYC) torch's bfloat16 matmul is a slow
fallback: 10 GFLOP/s against float32's ~90 on the same cores, and decode steps of the tiny
checkpoint 4.5x float32's. vLLM's CPU backend fares no better there: oneDNN cannot create a
bfloat16 matmul primitive on such a CPU, and vLLM falls back to the same ``F.linear``.

On such a CPU the weights are held in float32 (the bfloat16 values, exactly) and each
product runs in float32, its output rounded to the model's dtype. That is what a bfloat16
GEMM computes (bfloat16 operands, float32 accumulation, a bfloat16 result) up to the order
of the sums, so the model's numbers stay a bfloat16 model's. The cost: the projection
weights take twice the memory.

**Kernel.** Where it runs (AVX-512 F and BF16, the library built), a float32 or bfloat16
projection whose outputs fill panels of 32 runs on ``worker.models.packed_gemm``: 1.4-1.7x
faster than oneDNN at decode sizes, within a few percent of it from 64 rows on. Elsewhere, a float32 projection on the CPU
runs oneDNN's matmul over a weight reordered
once, at load, into oneDNN's blocked layout, as vLLM's CPU backend runs its linears
(``dispatch_cpu_unquantized_gemm``: ``create_onednn_mm`` over the weight). torch's
``F.linear`` repacks the weight on every call. Measured on the development machine (AVX2),
one thread, decode steps of the generated 51M-parameter Llama: 49 ms against 57 at 8 rows,
149 against 168 at 64. Small weights gain nothing (the tiny checkpoint's decode steps were
6% slower with every weight reordered), so only float32 weights of ``ONEDNN_MIN_WEIGHT``
elements or more are. A bfloat16 (float16) projection with a native GEMM runs on its
reordered weight at every size: on an AMD EPYC with AVX-512 BF16, one thread, llama50m's
four projection shapes took 0.56 ms against ``F.linear``'s 0.91 at 8 rows and 4.0 against
5.0 at 64, the tiny checkpoint's 0.08 against 0.12 at one row (the same bits either way).
The reordered weight replaces the plain one (no second copy); where oneDNN is not built
in, or refuses the weight, the plain weight and ``F.linear`` stay.

A float32 weight left to ``F.linear`` on the CPU is held column-major: the same (out, in)
tensor, its storage (in, out), so the product is ``x @ W`` over contiguous rows of W
rather than over a transposed operand. Measured, one thread, the tiny checkpoint's
projections in turn: 2.30 ms against 2.52 at 8 rows, 7.33 against 7.81 at 64, 0.73
against 1.11 at one.
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
