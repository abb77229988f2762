"""Which kernels read the cache in place: the C libraries on CPU
(``paged_decode``, ``paged_prefill``), Triton on CUDA (``triton_paged``); None where
neither runs, and the gather and SDPA take that part of the step.

``kernels``: ``auto`` (the device's own), ``triton`` (Triton on any device: on a CPU
under its interpreter, how the suite checks the CUDA kernels without a GPU), or
``none`` (the gather path everywhere).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from worker.attention import triton_paged
from worker.attention.paged_decode import load as load_paged_decode
from worker.attention.paged_prefill import load as load_paged_prefill

log = logging.getLogger(__name__)

KERNEL_CHOICES = ("auto", "triton", "none")


def in_place_kernels(
    kernels: str, device: torch.device, cache_dtype: torch.dtype, dtype: torch.dtype, head_dim: int, group: int,
    decode: bool = True, prefill: bool = True, block_size: int | None = None, num_kv_heads: int | None = None,
) -> tuple[Any | None, Any | None]:
    """(decode kernel, prefill kernel) for these caches, each None where the gather runs;
    ``decode`` / ``prefill`` False: that part gathers whatever runs here. With the cache's
    ``block_size`` and ``num_kv_heads``, a Triton kernel on CUDA is first run once on a
    small input (``triton_paged.self_check``) and left out, with a warning, if it fails."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {', '.join(KERNEL_CHOICES)}, got {kernels!r}")
    if kernels == "none":
        return None, None
    if kernels == "triton" or device.type == "cuda":
        found = (triton_paged.load_decode() if decode else None, triton_paged.load_prefill() if prefill else None)
    else:
        found = (load_paged_decode() if decode else None, load_paged_prefill() if prefill else None)
    chosen = [k if k is not None and k.supports(cache_dtype, dtype, device, head_dim, group) else None for k in found]
    if device.type == "cuda" and block_size is not None and num_kv_heads is not None:
        for i, k in enumerate(chosen):
            problem = None if k is None else triton_paged.self_check(k, cache_dtype, dtype, device, block_size, num_kv_heads, head_dim, group)
            if problem is not None:
                log.warning("the Triton %s kernel fails its check on %s (%s); that part of attention gathers blocks for SDPA",
                            k.name, device, problem)
                chosen[i] = None
    return chosen[0], chosen[1]
