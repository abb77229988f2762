"""Which checkpoint ``make compare`` serves, and the KV-cache layout both engines give it.

``--checkpoint tiny`` (the default) is the project's tiny Llama, ``--checkpoint gemma3``
its Gemma-3-style one (``worker/tiny/gemma3.py``: 5 sliding-window layers to 1 full, a
128-token window), the hybrid KV-cache groups' row; ``llama50m`` a 51M-parameter Llama in
bfloat16 (``worker/tiny/llama50m.py``), the compute-bound one of ``make compare-speed``;
``smollm2`` the real SmolLM2-135M-Instruct in bfloat16 (``bench/real_model.py``). The layout is read from the
checkpoint's ``config.json`` alone, read as kvpool's worker reads it
(``protocol.layer_windows``), with vLLM 0.32's grouping
(``protocol.kv_cache_spec.kv_cache_groups``): a block holds ``num_kv_tensors`` layers'
K and V, not every layer's, once layers fall into several groups — so the same pool in
blocks needs that many layers' bytes a block on both engines.
"""

from __future__ import annotations

import json
from pathlib import Path

from protocol.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups, num_kv_tensors
from protocol.layer_windows import layer_windows

CHECKPOINTS = ("tiny", "gemma3", "llama50m", "smollm2")


def checkpoint_dir(name: str) -> Path:
    """A generated (or, smollm2, converted) checkpoint's folder in the cache, written on first use."""
    if name == "tiny":
        from worker.tiny.generate import default_checkpoint

        return default_checkpoint()
    if name == "gemma3":
        from worker.tiny.gemma3 import gemma3_checkpoint

        return gemma3_checkpoint()
    if name == "llama50m":
        from worker.tiny.llama50m import llama50m_checkpoint

        return llama50m_checkpoint()
    if name == "smollm2":
        from bench.real_model import smollm2_checkpoint

        return smollm2_checkpoint()
    raise ValueError(f"unknown checkpoint {name!r} (generated ones: {', '.join(CHECKPOINTS)})")


def kv_groups(model: Path) -> list[KVCacheGroupSpec]:
    """The checkpoint's KV-cache groups, as vLLM 0.32 forms them with the hybrid manager."""
    path = model / "config.json"
    try:
        return kv_cache_groups(layer_windows(json.loads(path.read_text())))
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def kv_layers_per_block(model: Path) -> int:
    """Layers whose K and V one block holds: every layer with one group; with several,
    ``num_kv_tensors`` (one for Gemma 3's 5 : 1 pattern)."""
    return num_kv_tensors(kv_groups(model))


def max_window(model: Path) -> int:
    """The widest sliding window of any layer, 0 when every layer attends to all."""
    return max(g.sliding_window for g in kv_groups(model))


def describe(groups: list[KVCacheGroupSpec]) -> str:
    """``6 groups: [0] w128, ..., [5] full; 1 layer a block``."""
    each = ", ".join(
        f"{g.layer_ids} " + (f"w{g.sliding_window}" if g.sliding_window else "full") for g in groups
    )
    n = num_kv_tensors(groups)
    return f"{len(groups)} KV-cache group{'s' * (len(groups) > 1)}: {each}; {n} layer{'s' * (n > 1)} a block"
