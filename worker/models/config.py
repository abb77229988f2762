"""The model's shape and variant flags, read from a Hugging Face ``config.json``.

One frozen ``ModelConfig`` per checkpoint. Each supported architecture is a row of
``ARCHITECTURES``: which layer variants it uses (q/k/v biases, per-head q/k RMSNorm).
Everything else (shapes, RoPE and its scaling, tied embeddings, EOS ids) is read from
the config itself, so Llama, Qwen2, Qwen3 and Mistral share one model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelConfigError(ValueError):
    """A config.json kvpool cannot serve; the message names the file and the reason."""


@dataclass(frozen=True, slots=True)
class Variant:
    qkv_bias: bool | None  # None: the config's ``attention_bias`` decides (also for o_proj)
    qk_norm: bool  # RMSNorm over each head of q and k, before RoPE (Qwen3)


# NOTE: one row per architecture difference, not one model per architecture.
ARCHITECTURES: dict[str, Variant] = {
    "LlamaForCausalLM": Variant(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": Variant(qkv_bias=None, qk_norm=False),
    "Qwen2ForCausalLM": Variant(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Variant(qkv_bias=None, qk_norm=True),
}

ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    # ("default" | "linear" | "llama3", its parameters as sorted (key, value) pairs)
    rope_type: str
    rope_params: tuple[tuple[str, float], ...]
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # The window of sliding-window attention, None when every layer attends to all.
    sliding_window: int | None
    torch_dtype: str  # the checkpoint's dtype name ("float32", "bfloat16", ...)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's attention window, 0 for full attention (protocol.kv_cache_spec)."""
        return (self.sliding_window or 0,) * self.num_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def _rope(cfg: dict, where: str) -> tuple[float, str, tuple[tuple[str, float], ...]]:
    # transformers >= 5 writes ``rope_parameters`` (theta inside); older configs
    # ``rope_theta`` and ``rope_scaling`` (with "type" or "rope_type").
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"{where}: rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    numeric = tuple(sorted((k, float(v)) for k, v in params.items() if isinstance(v, int | float) and not isinstance(v, bool)))
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in dict(numeric)]
    if missing:
        raise ModelConfigError(f"{where}: rope type {rope_type!r} needs {', '.join(missing)}")
    return theta, rope_type, numeric


def _sliding_window(cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    # NOTE: Qwen2/Qwen3 configs carry a window that is off unless use_sliding_window.
    if "use_sliding_window" in cfg and not cfg["use_sliding_window"]:
        return None
    return int(window)


def model_config_from_hf(cfg: dict, generation_config: dict | None = None, where: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the parsed config.json (and generation_config.json)."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelConfigError(f"{where}: no 'architectures' entry (supported: {', '.join(ARCHITECTURES)})")
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise ModelConfigError(f"{where}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    variant = ARCHITECTURES[arch]
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        vocab, layers, inter = int(cfg["vocab_size"]), int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"])
    except KeyError as e:
        raise ModelConfigError(f"{where}: missing {e.args[0]!r}") from None
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{where}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise ModelConfigError(f"{where}: mlp_bias is not supported")
    if heads % kv_heads:
        raise ModelConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ModelConfigError(f"{where}: head_dim {head_dim} must be even for rotary embeddings")
    theta, rope_type, rope_params = _rope(cfg, where)
    attention_bias = bool(cfg.get("attention_bias", False))
    qkv_bias = attention_bias if variant.qkv_bias is None else variant.qkv_bias
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype not in DTYPES:
        raise ModelConfigError(f"{where}: dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    gen = generation_config or {}
    eos: list[int] = []
    for t in _ids(cfg.get("eos_token_id")) + _ids(gen.get("eos_token_id")):
        if t not in eos:
            eos.append(t)
    bad = [t for t in eos if not 0 <= t < vocab]
    if bad:
        raise ModelConfigError(f"{where}: eos_token_id {bad[0]} is outside the vocabulary of {vocab}")
    bos = cfg.get("bos_token_id", gen.get("bos_token_id"))
    return ModelConfig(
        architecture=arch, vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=theta, rope_type=rope_type,
        rope_params=rope_params, qkv_bias=qkv_bias, o_bias=attention_bias and variant.qkv_bias is None,
        qk_norm=variant.qk_norm, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=_sliding_window(cfg), torch_dtype=dtype,
        bos_token_id=None if bos is None else int(_ids(bos)[0]), eos_token_ids=tuple(eos),
    )
