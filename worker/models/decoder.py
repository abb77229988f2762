"""The decoder-only transformer for every supported architecture (Llama, Mistral,
Qwen2, Qwen3): pre-norm blocks of grouped-query attention and a SwiGLU MLP.

The variants are flags of one layer, not copies of the model: q/k/v (and o) biases are
``Linear`` biases that may be None; Qwen3's per-head q/k RMSNorm is ``q_norm``/``k_norm``
(None elsewhere). Under tensor parallelism (``worker/parallel/linear.py``) a rank's model holds only its
heads and MLP columns: ``num_heads``/``num_kv_heads`` are this rank's, o and down are
row-parallel (one all-reduce each); with one rank they are the model's. The model owns no KV cache: ``forward`` takes an ``AttentionFn`` that
receives each layer's rotated q and k and v and returns the attention output; the paged
runner plugs in paged attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from worker.models.config import ModelConfig
from worker.models.layers import GatedMLP, Linear, rms_norm
from worker.models.rope import RotaryEmbedding, apply_rope
from worker.parallel.linear import RowParallelLinear, TPShard


class AttentionFn(Protocol):
    """Attention for one layer over the tokens of one forward call.

    q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim), already rotated.
    Returns (T, num_heads, head_dim). Implementations store k/v in their cache first,
    so each token attends to every earlier token of its request and to itself.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor  # (H,)
    qkv: Linear  # (q_size + 2 * kv_size, H): q_proj, k_proj, v_proj rows (this rank's)
    o: Linear | RowParallelLinear  # (H, q_size)
    post_attention_norm: torch.Tensor  # (H,)
    mlp: GatedMLP
    q_norm: torch.Tensor | None = None  # (hd,) Qwen3
    k_norm: torch.Tensor | None = None  # (hd,)


class DecoderModel:
    """Weights plus the forward pass; stateless between calls."""

    def __init__(
        self, config: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: torch.Tensor, lm_head: torch.Tensor,
        shard: TPShard | None = None,
    ):
        self.config = config
        self.shard = shard
        # This rank's heads (the model's without tensor parallelism).
        self.num_heads = config.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = config.num_kv_heads if shard is None else shard.num_kv_heads
        self.embed = embed  # (V, H)
        self.layers = layers
        self.norm = norm  # (H,)
        self.lm_head = lm_head  # (V, H); the embedding itself when tied
        self.dtype = embed.dtype
        self.device = embed.device
        self.rotary = RotaryEmbedding(config, self.device)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """token_ids, positions: (T,) int64 on the model's device. Returns the final
        normed hidden states (T, H); ``compute_logits`` turns the rows you need into logits."""
        c = self.config
        T, eps, hd = token_ids.shape[0], c.rms_norm_eps, c.head_dim
        nh, kvh = self.num_heads, self.num_kv_heads
        q_size, kv_size = nh * hd, kvh * hd
        cos, sin = self.rotary.cos_sin(positions, self.dtype)  # (T, 1, hd/2) each
        x = self.embed[token_ids]  # (T, H)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, eps)
            qkv = layer.qkv(h)  # (T, q_size + 2 * kv_size)
            qk = qkv[:, : q_size + kv_size].view(T, nh + kvh, hd)  # q heads, then k heads
            v = qkv[:, q_size + kv_size :].view(T, kvh, hd)  # (T, kvh, hd)
            if layer.q_norm is not None:
                qk = torch.cat((rms_norm(qk[:, :nh], layer.q_norm, eps), rms_norm(qk[:, nh:], layer.k_norm, eps)), dim=1)
            # NOTE: q and k rotated in one pass; q (T, nh, hd) and k (T, kvh, hd) are views of it.
            qk = apply_rope(qk, cos, sin)
            o = attention(i, qk[:, :nh], qk[:, nh:], v)  # (T, nh, hd)
            x = x + layer.o(o.reshape(T, q_size))
            x = x + layer.mlp(rms_norm(x, layer.post_attention_norm, eps))
        return rms_norm(x, self.norm, eps)  # (T, H)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, V), float32 (float64 for a float64 model) for the sampler."""
        logits = torch.nn.functional.linear(hidden, self.lm_head)  # (N, V)
        return logits if logits.dtype == torch.float64 else logits.float()
