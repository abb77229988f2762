"""The model's shape and variant flags, read from a Hugging Face ``config.json``.

One frozen ``ModelConfig`` per checkpoint. Each supported architecture is a row of
``ARCHITECTURES``: which layer variants it uses (q/k/v biases, per-head q/k RMSNorm,
Gemma's (1 + w) norms, sandwich norms and scaled embeddings, a RoPE of its own for
sliding-window layers). Everything else (shapes, RoPE and its scaling, each layer's
attention window, tied embeddings, EOS ids) is read from the config itself, so Llama,
Qwen2, Qwen3, Mistral and Gemma 3 share one model class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from protocol.layer_windows import layer_windows

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
    qk_norm: bool  # RMSNorm over each head of q and k, before RoPE (Qwen3, Gemma 3)
    gemma: bool = False  # Gemma's differences, below (transformers' Gemma3TextModel)


# NOTE: one row per architecture difference, not one model per architecture.
ARCHITECTURES: dict[str, Variant] = {
    "LlamaForCausalLM": Variant(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": Variant(qkv_bias=None, qk_norm=False),
    "Qwen2ForCausalLM": Variant(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": Variant(qkv_bias=None, qk_norm=True),
    # Gemma: RMSNorm scales by (1 + w) in float32 before the cast; sandwich norms (after
    # attention, before and after the MLP); embeddings times sqrt(hidden) in the model
    # dtype; query_pre_attn_scalar ** -0.5 as the attention scale; a local RoPE base for
    # sliding-window layers; gelu_pytorch_tanh; tied embeddings by default.
    "Gemma3ForCausalLM": Variant(qkv_bias=None, qk_norm=True, gemma=True),
}

ROPE_TYPES = ("default", "linear", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class Rope:
    theta: float
    type: str  # "default" | "linear" | "llama3"
    params: tuple[tuple[str, float], ...] = ()  # its parameters, sorted (key, value) pairs


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
    rope: Rope  # full-attention layers' (every layer's without ``local_rope``)
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # The window of sliding-window attention (the widest layer's), None when every layer attends to all.
    sliding_window: int | None
    torch_dtype: str  # the checkpoint's dtype name ("float32", "bfloat16", ...)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json
    # Each layer's attention window, 0 for full attention (protocol.layer_windows).
    layer_windows: tuple[int, ...] = ()
    gemma: bool = False  # Variant.gemma
    hidden_act: str = "silu"  # the gated MLP's activation
    local_rope: Rope | None = None  # sliding-window layers' RoPE, when it differs (Gemma 3)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

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


def _rope(cfg: dict, where: str, default_theta: float = 10000.0) -> Rope:
    # transformers >= 5 writes ``rope_parameters`` (theta inside); older configs
    # ``rope_theta`` and ``rope_scaling`` (with "type" or "rope_type").
    return _parse_rope({**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})},
                       cfg.get("rope_theta", default_theta), where)


def _ropes(cfg: dict, variant: Variant, where: str) -> tuple[Rope, Rope | None]:
    """The full-attention layers' RoPE and, where it differs, the sliding layers'.

    Per layer type (transformers 5 writes ``rope_parameters`` as {"full_attention": {...},
    "sliding_attention": {...}} for Gemma 3), else Gemma 3's older ``rope_theta`` (and
    ``rope_scaling``) for full layers and ``rope_local_base_freq`` for sliding ones."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention", params.get("sliding_attention")), dict):
        defaults = (1_000_000.0, 10_000.0) if variant.gemma else (10_000.0, 10_000.0)
        full = _parse_rope(dict(params.get("full_attention") or {}), defaults[0], f"{where}: full_attention")
        local = _parse_rope(dict(params.get("sliding_attention") or {}), defaults[1], f"{where}: sliding_attention")
        return full, local
    if variant.gemma:
        local = Rope(float(cfg.get("rope_local_base_freq", 10_000.0)), "default")
        return _rope(cfg, where, 1_000_000.0), local
    return _rope(cfg, where), None


def _parse_rope(params: dict, default_theta: float, where: str) -> Rope:
    theta = float(params.pop("rope_theta", default_theta))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(f"{where}: rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    numeric = tuple(sorted((k, float(v)) for k, v in params.items() if isinstance(v, int | float) and not isinstance(v, bool)))
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    missing = [k for k in needed.get(rope_type, ()) if k not in dict(numeric)]
    if missing:
        raise ModelConfigError(f"{where}: rope type {rope_type!r} needs {', '.join(missing)}")
    return Rope(theta, rope_type, numeric)


def _windows(cfg: dict, where: str) -> tuple[int, ...]:
    try:
        return tuple(layer_windows(cfg))
    except ValueError as e:
        raise ModelConfigError(f"{where}: {e}") from None


def _gemma_fields(cfg: dict, where: str) -> dict:
    """Gemma 3's attention scale and logit softcapping; what kvpool cannot honour refused."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelConfigError(f"{where}: attn_logit_softcapping is not supported (vLLM 0.32's Gemma 3 does not apply it either)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelConfigError(f"{where}: use_bidirectional_attention (an embedding model) is not supported")
    cap = cfg.get("final_logit_softcapping")
    return {"attention_scale": float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
            "final_logit_softcapping": None if cap is None else float(cap)}


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
    act_key = "hidden_activation" if variant.gemma else "hidden_act"
    act = cfg.get(act_key) or ("gelu_pytorch_tanh" if variant.gemma else "silu")
    if act not in ACTIVATIONS:
        raise ModelConfigError(f"{where}: {act_key} {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if cfg.get("mlp_bias"):
        raise ModelConfigError(f"{where}: mlp_bias is not supported")
    if heads % kv_heads:
        raise ModelConfigError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ModelConfigError(f"{where}: head_dim {head_dim} must be even for rotary embeddings")
    rope, local_rope = _ropes(cfg, variant, where)
    windows = _windows(cfg, where)
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
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope=rope, qkv_bias=qkv_bias,
        o_bias=attention_bias and variant.qkv_bias is None, qk_norm=variant.qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", variant.gemma)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=max(windows) or None, torch_dtype=dtype,
        bos_token_id=None if bos is None else int(_ids(bos)[0]), eos_token_ids=tuple(eos),
        layer_windows=windows, gemma=variant.gemma, hidden_act=act,
        local_rope=local_rope if any(windows) and local_rope != rope else None,
        **(_gemma_fields(cfg, where) if variant.gemma else {}),
    )
