"""The bytes of one KV block of a checkpoint, worked out from its config.json, for the
benchmarks that size a pool the same way as another server (bench/compare/servers.py) and the
tests that check a worker's sizing. The servers themselves never re-derive it: the
worker reports its KV cache's dtype and block bytes (WorkerHello) and the scheduler
exports them (``kvpool_kv_block_bytes``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from protocol import kv_cache_spec
from protocol.layer_windows import layer_windows


def kv_bytes_per_block(model_dir: Path, block_size: int, dtype: str, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                       disable_hybrid: bool = False, disable_sliding_window: bool = False) -> int | None:
    """K and V of one block across the model's KV tensors (None if config.json does not
    say): every layer, or for a hybrid model ``num_kv_tensors`` of its KV-cache groups
    (the worker's sizing; ``disable_hybrid`` and ``disable_sliding_window`` are vLLM's
    flags). Under tensor parallelism what each rank holds (its KV heads, one when they
    are replicated). An fp8 ``kv_cache_dtype`` stores one byte an element whatever
    ``dtype`` is."""
    try:
        c = json.loads((Path(model_dir) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        kv_heads = max(1, (c.get("num_key_value_heads") or c["num_attention_heads"]) // tensor_parallel_size)
        name = (c.get("torch_dtype") or c.get("dtype") or "float32") if dtype == "auto" else dtype
        model_dtype = getattr(torch, str(name), None)
        if not isinstance(model_dtype, torch.dtype):
            return None
        size = kv_cache_spec.kv_cache_element_size(kv_cache_dtype, model_dtype.itemsize)
        windows = [0] * c["num_hidden_layers"] if disable_sliding_window else layer_windows(c)
        num_tensors = kv_cache_spec.num_kv_tensors(kv_cache_spec.kv_cache_groups(windows, disable_hybrid))
        return kv_cache_spec.kv_bytes_per_block(num_tensors, block_size, kv_heads, head_dim, size)
    except (OSError, ValueError, KeyError, TypeError):
        return None
