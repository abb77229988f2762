"""ModelShape: what vLLM's MFU estimates (scheduler/engine/perf_metrics.py) read from the
checkpoint's config.json, read once per scheduler process: by the flag check, which keeps
it in the frozen config (``SchedulerConfig.model_shape``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What perf.py reads from the model's config (vLLM's ParsedArgs, for a dense model),
    but the element sizes: those are the worker's (``estimate_step``)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> ModelShape:
        """From ``model_dir``/config.json. Raises ValueError naming what is missing or not supported."""
        path = Path(model_dir) / "config.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"--enable-mfu-metrics: cannot read {path}: {e}") from None
        cfg = cfg.get("text_config") or cfg
        for key in ("num_local_experts", "num_experts", "n_routed_experts", "kv_lora_rank", "quantization_config"):
            if cfg.get(key):
                raise ValueError(f"--enable-mfu-metrics: {path} has {key!r}; only dense, unquantized llama-style models are estimated")
        try:
            hidden, heads, layers, vocab = (int(cfg[k]) for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"))
        except KeyError as e:
            raise ValueError(f"--enable-mfu-metrics: {path} has no {e.args[0]!r}") from None
        return cls(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg.get("intermediate_size") or 4 * hidden), vocab_size=vocab,
        )
