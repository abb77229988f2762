"""Rotary position embeddings (the "rotate half" layout of Llama and its kin).

Angles come from the positions on the fly (no table of max_position_embeddings rows).
The inverse frequencies are computed in float32 as transformers computes them, then
changed by the config's scaling: ``linear`` divides them by ``factor``; ``llama3``
divides the low frequencies by ``factor``, keeps the high ones and blends between.
"""

from __future__ import annotations

import math

import torch

from worker.models import norm_act
from worker.models.config import Rope


def inv_frequencies(head_dim: int, rope: Rope) -> torch.Tensor:
    """(head_dim / 2,) float32."""
    dim = head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (hd/2,)
    p = dict(rope.params)
    if rope.type == "linear":
        return inv_freq / p["factor"]
    if rope.type == "llama3":
        factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
        old_len = p["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding:
    def __init__(self, head_dim: int, rope: Rope, device: torch.device):
        self.inv_freq = inv_frequencies(head_dim, rope).to(device)  # (hd/2,) float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, hd/2) in ``dtype``, shared by every layer."""
        # NOTE: angles in float32 whatever the model's dtype, as transformers computes
        # them: half precision cannot hold positions past 2048 exactly, and float64
        # angles would differ from the reference's.
        angles = positions.float()[:, None] * self.inv_freq  # (T, hd/2)
        return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, hd), which may be a strided view, by cos/sin (T, 1, hd/2);
    a new contiguous (T, heads, hd).

    NOTE: each half is written in place of a ``cat``: four ops instead of seven, no
    temporaries, which a microbenchmark of q and k of a long step found faster. A bfloat16
    x goes through ``worker.models.norm_act``'s one pass where it runs, with the same roundings."""
    fused = norm_act.load() if x.dtype == torch.bfloat16 else None
    if fused is not None and fused.supports_rope(x, cos, sin):
        return fused.rope(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)  # (T, heads, hd/2) each
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)  # x2 cos + x1 sin
    return out
