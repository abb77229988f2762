"""The tiny decoder-only transformer whose K/V fill the paged cache.

RMSNorm, rotary position embeddings (NeoX "rotate half" layout, angles computed on
the fly from positions, so there is no max-position table), grouped-query attention
and a SwiGLU MLP. Weights are drawn from a seeded ``torch.Generator`` on the CPU in
float32 and only then cast and moved, so the same (config, seed) gives the same model
on every device and in every process (the reference in a test and the worker).

The model does not own a KV cache: ``forward`` takes an ``AttentionFn`` that receives
each layer's q/k/v and returns the attention output. The paged runner and the
contiguous reference plug in their own; everything else is shared code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The model's shape. Defaults are what the scheduler and load generator assume."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 384
    eos_token_id: int = 1
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} is outside the vocabulary of {self.vocab_size}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class AttentionFn(Protocol):
    """Attention for one layer over the tokens of one forward call.

    q: (T, num_heads, head_dim); k, v: (T, num_kv_heads, head_dim), already rotated.
    Returns (T, num_heads, head_dim). Implementations store k/v in their cache first,
    so each token attends to every earlier token of its request and to itself.
    """

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # (H,)
    wqkv: torch.Tensor  # (H, (nh + 2*kvh) * hd)
    wo: torch.Tensor  # (nh * hd, H)
    mlp_norm: torch.Tensor  # (H,)
    w_gate_up: torch.Tensor  # (H, 2 * I)
    w_down: torch.Tensor  # (I, H)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class TinyModel:
    """Weights plus the forward pass; stateless between calls."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
    ):
        self.config = config
        self.embed = embed  # (V, H)
        self.layers = layers
        self.final_norm = final_norm  # (H,)
        self.lm_head = lm_head  # (H, V)
        self.dtype = embed.dtype
        self.device = embed.device
        # NOTE: angles in float32 (float64 for a float64 model): half precision cannot
        # hold positions past 2048 exactly.
        self._angle_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        half = config.head_dim // 2
        exponent = torch.arange(half, dtype=torch.float64) * 2 / config.head_dim
        self._inv_freq = (1.0 / (config.rope_theta**exponent)).to(self._angle_dtype).to(self.device)  # (hd/2,)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x (T, heads, hd) by the angles of positions (T,)."""
        angles = positions.to(self._angle_dtype)[:, None] * self._inv_freq  # (T, hd/2)
        cos = angles.cos().to(x.dtype)[:, None, :]  # (T, 1, hd/2)
        sin = angles.sin().to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)  # (T, heads, hd/2) each
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """token_ids, positions: (T,) int64 on the model's device. Returns the final
        normed hidden states (T, H); ``compute_logits`` turns the rows you need into logits."""
        c = self.config
        T = token_ids.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        x = self.embed[token_ids]  # (T, H)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.attn_norm, c.rms_norm_eps)
            qkv = h @ w.wqkv  # (T, q_size + 2*kv_size)
            q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
            q = self.rope(q.view(T, c.num_heads, c.head_dim), positions)  # (T, nh, hd)
            k = self.rope(k.view(T, c.num_kv_heads, c.head_dim), positions)  # (T, kvh, hd)
            v = v.reshape(T, c.num_kv_heads, c.head_dim)  # (T, kvh, hd)
            o = attention(i, q, k, v)  # (T, nh, hd)
            x = x + o.reshape(T, q_size) @ w.wo
            h = rms_norm(x, w.mlp_norm, c.rms_norm_eps)
            gate, up = (h @ w.w_gate_up).chunk(2, dim=-1)  # (T, I) each
            x = x + (F.silu(gate) * up) @ w.w_down
        return rms_norm(x, self.final_norm, c.rms_norm_eps)  # (T, H)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, H) -> (N, V)."""
        return hidden @ self.lm_head


def build_model(
    config: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> TinyModel:
    """The worker's model, built exactly as ``python -m worker`` builds it from
    (shape flags, --seed, --dtype, --device)."""
    if isinstance(dtype, str):
        dtype = DTYPES[dtype]
    c = config
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        # NOTE: drawn in float32 on the CPU whatever the target, so every dtype and
        # device gets the same weights (up to rounding).
        t = torch.randn(*shape, generator=gen, dtype=torch.float32) * std
        return t.to(dtype=dtype, device=device)

    def norm_weight() -> torch.Tensor:
        return 1.0 + normal(c.hidden_size, std=0.1)

    H, qkv_out = c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    embed = normal(c.vocab_size, H, std=1.0)
    layers = []
    for _ in range(c.num_layers):
        layers.append(
            LayerWeights(
                attn_norm=norm_weight(),
                # NOTE: a larger q/k scale makes attention peaky rather than uniform,
                # so the context (and therefore the cache) actually changes the output.
                wqkv=normal(H, qkv_out, std=2.0 / math.sqrt(H)),
                wo=normal(c.num_heads * c.head_dim, H, std=1.0 / math.sqrt(c.num_heads * c.head_dim)),
                mlp_norm=norm_weight(),
                w_gate_up=normal(H, 2 * c.intermediate_size, std=1.0 / math.sqrt(H)),
                w_down=normal(c.intermediate_size, H, std=1.0 / math.sqrt(c.intermediate_size)),
            )
        )
    final_norm = norm_weight()
    # NOTE: logits of std ~3 keep greedy decoding varied (not one token forever) while
    # leaving clear winners, so float64 paged and reference runs pick the same argmax.
    lm_head = normal(H, c.vocab_size, std=3.0 / math.sqrt(H))
    return TinyModel(config, embed, layers, final_norm, lm_head)
