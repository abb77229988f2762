"""A generated Llama of about 51 million parameters, stored in bfloat16: the compute-bound
checkpoint of ``make compare-speed`` (the tiny one, ~3.3M, measures mostly the engines'
per-step overheads; this one spends most of a step in matmuls).

Made as the tiny Llama is (``worker/tiny/generate.py``): the same weight draws (scaled so
activations stay sane), seed and writer, the tiny tokenizer (vocab 512), only the shape
larger — hidden 768, 12 heads of 64, 4 KV heads, intermediate 2048, 8 layers, an untied
LM head. The weights are drawn in float32 and rounded once to bfloat16
(``torch_dtype: "bfloat16"``), so every engine reading it in float32 sees the same
values. Deterministic; ``llama50m_checkpoint()`` caches it beside the tiny one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from worker.tiny.generate import CONFIG as TINY_CONFIG
from worker.tiny.generate import cached_checkpoint, random_weights, write_checkpoint

NAME = "kvpool-llama50m-v1"  # NOTE: change the version when any file changes
CONFIG = TINY_CONFIG | {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "torch_dtype": "bfloat16",
}


def bf16_weights(config: dict = CONFIG) -> dict[str, torch.Tensor]:
    """generate.py's float32 draws for ``config``, rounded to bfloat16."""
    return {k: v.to(torch.bfloat16) for k, v in random_weights(config).items()}


def write_llama50m_checkpoint(directory: str | Path) -> Path:
    """Write the whole checkpoint into ``directory`` (created if needed)."""
    return write_checkpoint(directory, CONFIG, bf16_weights())


def llama50m_checkpoint() -> Path:
    """The 50M Llama's directory in the cache folder, generated on first use."""
    return cached_checkpoint(NAME, write_llama50m_checkpoint)
