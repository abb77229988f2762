"""KV cache sizing and allocation.

One tensor per layer, ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (index 0
holds K, 1 holds V), allocated once at start-up and never reallocated while serving.
The number of blocks is the memory budget divided by the bytes one block takes across
all layers; block 0 is the scheduler's null block and is counted like any other.

Hybrid models (KV-cache groups, protocol.kv_cache_spec): ``num_kv_tensors(groups)``
tensors, shared by the layers of different groups as vLLM shares them
(``layer_kv_caches``), and a block costs that many layers, not every layer. What moves
a block by id (the tiers, P/D) moves it across ``distinct_kv_tensors``.
"""

from __future__ import annotations

import logging
import re

import torch

from protocol import kv_cache_spec
from protocol.kv_cache_spec import KVCacheGroupSpec

log = logging.getLogger(__name__)

# Same-size integer dtypes by element size: KV copies through numpy are bitwise views
# (numpy has no bfloat16).
SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str) -> int:
    """Bytes from a size like ``512MiB``, ``2GiB``, ``64M``, ``1.5G``, ``4096``.

    K/M/G/T and KiB/MiB/GiB/TiB are binary (powers of 1024); KB/MB/GB/TB are decimal
    (powers of 1000); a bare number is bytes. Raises ValueError on anything else.
    """
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"invalid size {text!r}: expected a number with an optional unit, e.g. 512MiB, 2GiB, 64M, 1000000")
    number, prefix, binary, byte_suffix = m.groups()
    prefix = prefix.lower()
    if binary and not prefix:
        raise ValueError(f"invalid size {text!r}: 'i' needs a unit prefix (KiB, MiB, GiB, TiB)")
    # NOTE: "64M" means MiB, as in most command-line tools; only an explicit
    # "MB" is decimal.
    base = 1000 if (byte_suffix and not binary and prefix) else 1024
    size = int(float(number) * base ** _POWERS[prefix])
    if size <= 0:
        raise ValueError(f"invalid size {text!r}: must be more than 0 bytes")
    return size


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """torch's name of ``dtype`` without the module: ``bfloat16``, ``float8_e4m3fn``."""
    return str(dtype).removeprefix("torch.")


def distinct_kv_tensors(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The KV tensors of ``caches`` (one entry per layer), each once, in order of first
    appearance: what moves blocks by id (the host tier, the external tier, P/D) copies
    these. A block id belongs to one KV-cache group at a time, so block b across them is
    b's whole KV whichever group holds it. One group of every layer: ``caches`` as it is.

    NOTE: by object identity: ``layer_kv_caches`` and ``first_blocks`` keep the entries
    of one tensor one object.
    """
    return list({id(kv): kv for kv in caches}.values())


def block_bytes(caches: list[torch.Tensor]) -> int:
    """Bytes of one block, K and V, across the KV tensors of ``caches`` (one entry per
    layer; a tensor that layers of different groups share is counted once)."""
    return sum(kv[:, 0].numel() * kv.element_size() for kv in distinct_kv_tensors(caches))  # kv[:, 0]: (2, block_size, kvh, hd)


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V (protocol.kv_cache_spec's formula)."""
    return kv_cache_spec.kv_bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype_bytes(dtype))


def num_blocks_for_budget(budget_bytes: int, bytes_per_block: int) -> int:
    return budget_bytes // bytes_per_block


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float, activation_peak_bytes: int,
                   before_load: tuple[int, int]) -> int:
    """Bytes left for the KV cache when this process may use ``gpu_memory_utilization``
    of the device's total memory, as vLLM's worker counts it: what this process took since
    ``before_load`` (the device's (free, total) before the weights loaded) and the profiled
    activation peak count against that share; other processes' memory does not (two
    engines at 0.45 share one device). Raises ValueError, as vLLM refuses to start, when
    the device had less than that share free before the load."""
    free_before, total = before_load
    requested = int(total * gpu_memory_utilization)
    if free_before < requested:
        raise ValueError(f"free memory on {device} before loading ({free_before / 2**30:.2f}/{total / 2**30:.2f} GiB) is less than "
                         f"--gpu-memory-utilization {gpu_memory_utilization} asks for ({requested / 2**30:.2f} GiB); lower it, "
                         "or free memory other processes use")
    free_now, _ = torch.cuda.mem_get_info(device)
    taken = free_before - free_now  # weights, this process's CUDA buffers
    return max(0, requested - taken - activation_peak_bytes)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` tensor per layer."""
    if num_blocks < 2:
        raise ValueError(f"a KV cache needs at least 2 blocks (block 0 is the null block), got {num_blocks}")
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    # NOTE: zeroed, not empty: padding slots of the null block are read (and masked
    # out) by batched attention; garbage there could be NaN, and 0 * NaN is NaN.
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def layer_kv_caches(tensors: list[torch.Tensor], groups: list[KVCacheGroupSpec]) -> list[torch.Tensor]:
    """One entry per layer: layer L's tensor, ``layer_tensor_index(groups)[L]`` (layers of
    different groups share one object). One group of every layer: ``tensors`` as it is."""
    index = kv_cache_spec.layer_tensor_index(groups)
    if len(tensors) != kv_cache_spec.num_kv_tensors(groups):
        raise ValueError(f"{len(tensors)} KV tensors for groups that need {kv_cache_spec.num_kv_tensors(groups)}")
    return [tensors[index[layer]] for layer in range(len(index))]


def first_blocks(caches: list[torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """Each per-layer cache cut to its first ``num_blocks`` blocks; entries that were one
    tensor (shared by layers of different groups) stay one view."""
    views: dict[int, torch.Tensor] = {}
    return [views.setdefault(id(kv), kv[:, :num_blocks]) for kv in caches]


def allocate_host_kv_caches(device_caches: list[torch.Tensor], num_host_blocks: int) -> list[torch.Tensor]:
    """The offload tier's host memory: one zeroed tensor per distinct KV tensor of
    ``device_caches`` (``distinct_kv_tensors``: per layer, less a hybrid model's shared
    ones) with its layout, ``(2, num_host_blocks, block_size, kvh, hd)``, page-locked
    when the device cache is on CUDA (so copies to and from it can run asynchronously).
    A host slot thus holds ``block_bytes(device_caches)``, whatever group owns the block.

    NOTE: zeroed, so every page is backed now: the hello then promises only memory
    the worker holds, not an overcommitted promise the kernel may break later.
    """
    if num_host_blocks < 1:
        raise ValueError(f"a host KV tier needs at least 1 block, got {num_host_blocks}")
    lock = device_caches[0].device.type == "cuda"
    return [page_locked_zeros((kv.shape[0], num_host_blocks, *kv.shape[2:]), kv.dtype) if lock else
            torch.zeros((kv.shape[0], num_host_blocks, *kv.shape[2:]), dtype=kv.dtype) for kv in distinct_kv_tensors(device_caches)]


def page_locked_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed host memory that CUDA copies to and from asynchronously: registered with
    cudaHostRegister, byte for byte. NOTE: not ``pin_memory=True``, whose allocator rounds
    each request up to a power of two (a 2.3 GiB layer would lock 4 GiB, the whole tier
    nearly twice what was asked). Where registering fails, the memory stays pageable (its
    copies then wait for the device), with a warning."""
    t = torch.zeros(shape, dtype=dtype)
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(rc) != 0:
        log.warning("cudaHostRegister of %d bytes failed (%s); the host KV tier stays pageable", t.numel() * t.element_size(), rc)
    return t
