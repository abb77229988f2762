"""The decoder-only transformer for every supported architecture (Llama, Mistral,
Qwen2, Qwen3, Gemma 3): pre-norm blocks of grouped-query attention and a gated MLP.

The variants are flags of one layer, not copies of the model: q/k/v (and o) biases are
``Linear`` biases that may be None; Qwen3's and Gemma's per-head q/k RMSNorm is
``q_norm``/``k_norm`` (None elsewhere); Gemma's sandwich norms are
``pre_feedforward_norm``/``post_feedforward_norm`` (None elsewhere; with them
``post_attention_norm`` norms the attention's output), its norms scale by (1 + w)
(``gemma_rms_norm``), its embeddings by sqrt(hidden), and its sliding-window layers
rotate with their own RoPE base (``local_rope``). Under tensor parallelism (``worker/parallel/linear.py``) a rank's model holds only its
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
from worker.models.gemm import gemm_dtype
from worker.models.layers import GatedMLP, Linear, gemma_rms_norm, make_linear, rms_norm
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
    q_norm: torch.Tensor | None = None  # (hd,) Qwen3, Gemma 3
    k_norm: torch.Tensor | None = None  # (hd,)
    pre_feedforward_norm: torch.Tensor | None = None  # (H,) Gemma's sandwich norms
    post_feedforward_norm: torch.Tensor | None = None  # (H,)
    local_rope: bool = False  # rotates with the model's local RoPE (a Gemma 3 sliding-window layer)


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
        self.dtype = embed.dtype
        self.device = embed.device
        self.tied = lm_head is embed
        # NOTE: an untied head lives only here (column-major, reordered or widened: worker.models.gemm);
        # a tied one also as the embedding, which lookups need as it is.
        self.logits_proj = make_linear(lm_head, None, gemm_dtype(self.dtype, self.device))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, self.device)
        self.local_rotary = None if config.local_rope is None else RotaryEmbedding(config.head_dim, config.local_rope, self.device)
        # NOTE: Gemma's norms hold 1 + w in float32 (the loader makes them so).
        self.rms_norm = gemma_rms_norm if config.gemma else rms_norm
        # sqrt(hidden) rounded to the model dtype, as transformers and vLLM multiply by it.
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=self.dtype, device=self.device) if config.gemma else None

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """token_ids, positions: (T,) int64 on the model's device. Returns the final
        normed hidden states (T, H); ``compute_logits`` turns the rows you need into logits."""
        c = self.config
        T, eps, hd = token_ids.shape[0], c.rms_norm_eps, c.head_dim
        nh, kvh = self.num_heads, self.num_kv_heads
        q_size, kv_size = nh * hd, kvh * hd
        norm = self.rms_norm
        rope = self.rotary.cos_sin(positions, self.dtype)  # cos, sin (T, 1, hd/2) each
        local = rope if self.local_rotary is None else self.local_rotary.cos_sin(positions, self.dtype)
        x = self.embed[token_ids]  # (T, H)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for i, layer in enumerate(self.layers):
            h = norm(x, layer.input_norm, eps)
            qkv = layer.qkv(h)  # (T, q_size + 2 * kv_size)
            qk = qkv[:, : q_size + kv_size].view(T, nh + kvh, hd)  # q heads, then k heads
            v = qkv[:, q_size + kv_size :].view(T, kvh, hd)  # (T, kvh, hd)
            if layer.q_norm is not None:
                qk = torch.cat((norm(qk[:, :nh], layer.q_norm, eps), norm(qk[:, nh:], layer.k_norm, eps)), dim=1)
            # NOTE: q and k rotated in one pass; q (T, nh, hd) and k (T, kvh, hd) are views of it.
            qk = apply_rope(qk, *(local if layer.local_rope else rope))
            o = attention(i, qk[:, :nh], qk[:, nh:], v)  # (T, nh, hd)
            if layer.post_feedforward_norm is None:
                x = x + layer.o(o.reshape(T, q_size))
                x = x + layer.mlp(norm(x, layer.post_attention_norm, eps))
            else:  # Gemma's sandwich: each sublayer's output normed before the residual add
                x = x + norm(layer.o(o.reshape(T, q_size)), layer.post_attention_norm, eps)
                x = x + norm(layer.mlp(norm(x, layer.pre_feedforward_norm, eps)), layer.post_feedforward_norm, eps)
        return norm(x, self.norm, eps)  # (T, H)

    @property
    def lm_head(self) -> torch.Tensor:
        """(V, H) in the model's dtype; the embedding itself when tied (a copy otherwise)."""
        if self.tied:
            return self.embed
        return self.logits_proj.dense_weight().to(self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, V), float32 (float64 for a float64 model) for the sampler."""
        logits = self.logits_proj(hidden)  # (N, V), the model's dtype
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if logits.dtype == torch.float64 else logits.float()
