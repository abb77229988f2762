"""How much memory a device has for a KV cache, checked before allocating it.

A budget the device cannot hold is refused at the worker, with a clear message,
before it says hello: a scheduler never builds a pool for memory that is not there.
"""

from __future__ import annotations

import os

import torch


def available_memory_bytes(device: torch.device) -> int:
    """Bytes the device can still allocate: CUDA's free memory, or on CPU the kernel's
    MemAvailable (physical memory where /proc/meminfo is absent)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def format_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def check_kv_budget(budget_bytes: int, device: torch.device, available_bytes: int | None = None, flag: str = "--kv-cache-memory") -> None:
    """Raise ValueError when the KV budget is more than the device has available;
    ``flag`` is the one that set its size (the message says to lower it)."""
    available = available_memory_bytes(device) if available_bytes is None else available_bytes
    if budget_bytes > available:
        raise ValueError(
            f"a KV cache of {format_bytes(budget_bytes)} does not fit: the device ({device}) has "
            f"{format_bytes(available)} available; lower {flag}"
        )


def check_host_tier_budget(budget_bytes: int, available_bytes: int | None = None) -> None:
    """Raise ValueError when the host KV tier (--kv-offloading-size) is more than the
    host has available (MemAvailable, counted after the device cache is allocated)."""
    available = available_memory_bytes(torch.device("cpu")) if available_bytes is None else available_bytes
    if budget_bytes > available:
        raise ValueError(
            f"a host KV tier of {format_bytes(budget_bytes)} does not fit: the host has "
            f"{format_bytes(available)} of memory available; lower --kv-offloading-size"
        )
