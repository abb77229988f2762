"""Random Hugging Face checkpoints made with ``transformers`` (the reference
implementation; a test-only dependency, never imported by kvpool itself).

``make_checkpoint(kind, dir)`` builds a tiny model of one supported architecture (or a
variant: RoPE scaling, explicit head_dim, tied embeddings) with weights from a fixed
seed, scaled so that greedy decoding has clear winners, and ``save_pretrained``s it.
``WINDOW_KINDS`` have sliding-window layers (window ``WINDOW`` tokens): Gemma 3 with
sliding and full layers, Qwen2 with its first layer full (``max_window_layers``), and
Mistral with every layer sliding; ``gemma3-tied`` is Gemma 3 with its lm_head tied to
the embeddings, as Google's checkpoints are.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

VOCAB, EOS = 256, 1
WINDOW = 16


def _configs():
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=0, eos_token_id=EOS, rms_norm_eps=1e-6)
    return {
        "llama": lambda: tf.LlamaConfig(**common),
        # explicit head_dim (not hidden / heads) and Llama 3's RoPE scaling
        "llama3-rope": lambda: tf.LlamaConfig(**{**common, "head_dim": 24}, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "llama-linear-rope": lambda: tf.LlamaConfig(**common, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        "llama-bias": lambda: tf.LlamaConfig(**common, attention_bias=True),
        "qwen2": lambda: tf.Qwen2Config(**common, tie_word_embeddings=True),
        "qwen3": lambda: tf.Qwen3Config(**{**common, "head_dim": 32}),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=None),
        # Gemma 3: two sliding layers then a full one, twice; query_pre_attn_scalar is not
        # head_dim; the full layers' RoPE has linear scaling, the sliding ones' a local base.
        # NOTE: head_dim 32, which vLLM's CPU attention supports (16 it refuses); lm_head
        # untied, since a random model with tied ones greedily repeats its last token.
        "gemma3": lambda: _gemma3(tf, common, tie_word_embeddings=False),
        "gemma3-tied": lambda: _gemma3(tf, common, tie_word_embeddings=True),
        "qwen2-sliding": lambda: tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "mistral-sliding": lambda: tf.MistralConfig(**{**common, "head_dim": 32}, sliding_window=WINDOW),  # vLLM's CPU attention: head_dim 32
    }


KINDS = ["llama", "llama3-rope", "llama-linear-rope", "llama-bias", "qwen2", "qwen3", "mistral"]
WINDOW_KINDS = ["gemma3", "qwen2-sliding", "mistral-sliding"]


def _gemma3(tf, common: dict, tie_word_embeddings: bool):
    return tf.Gemma3TextConfig(
        **{**common, "num_hidden_layers": 6, "head_dim": 32}, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2, tie_word_embeddings=tie_word_embeddings,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    H = model.config.hidden_size
    # NOTE: Gemma's norms scale by (1 + w): w near 0 is a norm near 1.
    norm_base = 0.0 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1 and "norm" in name:
                p.copy_(norm_base + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "embed_tokens" in name:
                # NOTE: Gemma scales its embeddings by sqrt(H): unit-size ones would
                # swamp the residual stream, whose sublayer outputs are normed to ~1.
                p.copy_(noise / math.sqrt(H) if norm_base == 0.0 else noise)
            elif "lm_head" in name:
                p.copy_(noise * 3.0 / math.sqrt(H))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p.copy_(noise * 2.0 / math.sqrt(p.shape[1]))
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))


def make_checkpoint(kind: str, directory: str | Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    config = _configs()[kind]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(directory), **kwargs)
    return Path(directory)


def load_reference(directory: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    model.eval()
    return model


@torch.inference_mode()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """(T, V) float logits at every position of the sequence, one forward pass."""
    return model(torch.tensor([token_ids])).logits[0].to(torch.float64)


@torch.inference_mode()
def reference_generate(model, prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> list[int]:
    """Greedy ``model.generate(do_sample=False)``: the output tokens only."""
    eos = None if ignore_eos else model.generation_config.eos_token_id
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
