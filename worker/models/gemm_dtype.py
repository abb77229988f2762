"""The dtype a model's matrix products run in.

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
"""

from __future__ import annotations

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


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
