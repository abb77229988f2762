"""Which kernels read the cache in place: the C libraries on CPU
(``paged_decode``, ``paged_prefill``), Triton on CUDA (``triton_paged``); None where
neither runs, and the gather and SDPA take that part of the step.

``kernels``: ``auto`` (the device's own), ``triton`` (Triton on any device: on a CPU
under its interpreter, how the suite checks the CUDA kernels without a GPU), or
``none`` (the gather path everywhere).
"""

from __future__ import annotations

from typing import Any

import torch

from worker.attention import triton_paged
from worker.attention.paged_decode import load as load_paged_decode
from worker.attention.paged_prefill import load as load_paged_prefill

KERNEL_CHOICES = ("auto", "triton", "none")


def in_place_kernels(
    kernels: str, device: torch.device, cache_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, group: int,
    decode: bool = True, prefill: bool = True,
) -> tuple[Any | None, Any | None]:
    """(decode kernel, prefill kernel) for these caches, each None where the gather runs;
    ``decode`` / ``prefill`` False: that part gathers whatever runs here."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    if kernels == "none":
        return None, None
    if kernels == "triton" or device.type == "cuda":
        found = (triton_paged.load_decode() if decode else None, triton_paged.load_prefill() if prefill else None)
    else:
        found = (load_paged_decode() if decode else None, load_paged_prefill() if prefill else None)
    return tuple(k if k is not None and k.supports(cache_dtype, dtype, device, head_dim, group) else None for k in found)  # type: ignore[return-value]
