"""The small layers every supported architecture is built from.

Weights keep the checkpoint's layout (``(out, in)``, as ``nn.Linear``), so loading is
a copy and ``F.linear`` runs them; fused projections are rows concatenated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.models import norm_act, packed_gemm
from worker.models.gemm import column_major, onednn_linear, onednn_weight


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., D) normalised over D in float32, then scaled by weight (D,), as
    transformers' LlamaRMSNorm computes it (the reference the tests hold us to); in one
    pass where ``worker.models.norm_act`` runs."""
    fused = norm_act.load()
    if fused is not None and fused.supports(x, weight):
        return fused.rms_norm(x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight_plus_one: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, as transformers' Gemma3RMSNorm and vLLM's GemmaRMSNorm compute
    it: x (..., D) normalised in float32, times (1 + w) in float32, then cast.
    ``weight_plus_one`` (D,) float32 is ``1.0 + w.float()``, made once at load."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight_plus_one).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``gelu_pytorch_tanh`` (Gemma's MLP activation)."""
    return F.gelu(x, approximate="tanh")


ACTIVATION_FNS = {"silu": F.silu, "gelu_pytorch_tanh": gelu_tanh}


@dataclass(slots=True)
class Linear:
    """y = x @ weight.T + bias. With ``out_dtype``, the weights are held in a wider dtype
    than the model's (``worker.models.gemm``): x is widened, the output rounded back.
    ``kernel`` says how ``weight`` is held and multiplied: "torch" (out, in) through
    ``F.linear``; "onednn", oneDNN's blocked layout (``gemm.onednn_weight``); "packed",
    ``worker.models.packed_gemm``'s panels."""

    weight: torch.Tensor  # (out, in), or the kernel's layout of it
    bias: torch.Tensor | None = None  # (out,)
    out_dtype: torch.dtype | None = None  # the model's dtype, when the weights are wider
    kernel: str = "torch"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.out_dtype is not None:
            x = x.to(self.weight.dtype)
        if self.kernel == "packed":
            y = packed_gemm.load()(x, self.weight, self.bias)  # (..., out)
        elif self.kernel == "onednn":
            y = onednn_linear(x, self.weight, self.bias)
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if self.out_dtype is None else y.to(self.out_dtype)

    @property
    def out_features(self) -> int:
        return packed_gemm.PackedGemm.shape(self.weight)[0] if self.kernel == "packed" else self.weight.shape[0]

    def dense_weight(self) -> torch.Tensor:
        """The (out, in) weight, in the dtype it is held in (a copy unless plain)."""
        if self.kernel == "packed":
            return packed_gemm.PackedGemm.unpack(self.weight)
        return self.weight.to_dense() if self.kernel == "onednn" else self.weight


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, compute: torch.dtype) -> Linear:
    """A Linear whose product runs in ``compute`` (the weights' own dtype or wider): on
    the packed kernel where it runs (``worker.models.packed_gemm``), else on oneDNN's
    reordered weight where that is faster, else ``F.linear``."""
    out_dtype = None if compute == weight.dtype else weight.dtype
    weight, bias = weight.to(compute), None if bias is None else bias.to(compute).contiguous()
    kernel = packed_gemm.load()
    if kernel is not None and kernel.supports(weight):
        return Linear(kernel.pack(weight), bias, out_dtype, kernel="packed")
    reordered = onednn_weight(weight)
    if reordered is not None:
        return Linear(reordered, bias, out_dtype, kernel="onednn")
    return Linear(column_major(weight), bias, out_dtype)


# NOTE: gate/up and the activation run over at most this many rows at a time, so that
# the (T, 2I) product of a long prefill stays in cache for silu and the product; short
# inputs run alike either way.
MLP_CHUNK_ROWS = 256


@dataclass(slots=True)
class GatedMLP:
    """SwiGLU: down(act(gate(x)) * up(x)), gate and up fused into one projection; ``act``
    is silu (GeGLU's tanh gelu for Gemma).

    Wide inputs (prefill steps) go through gate/up and the activation in row chunks;
    down runs once over all rows (under tensor parallelism: one all-reduce)."""

    gate_up: Linear  # (2 * I, H)
    down: Linear  # (H, I)
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        if x.dim() != 2 or T <= 2 * MLP_CHUNK_ROWS:
            return self.down(self._act(self.gate_up(x)))  # (T, H)
        act = x.new_empty((T, self.gate_up.out_features // 2))  # (T, I), the model's dtype
        for s in range(0, T, MLP_CHUNK_ROWS):
            self._act(self.gate_up(x[s : s + MLP_CHUNK_ROWS]), act[s : s + MLP_CHUNK_ROWS])
        return self.down(act)  # (T, H)

    def _act(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """act(gate) * up of gate_up (T, 2I), into ``out`` (T, I) when given; silu's in one
        pass where ``worker.models.norm_act`` runs."""
        fused = norm_act.load() if self.act is F.silu and gate_up.dim() == 2 else None
        if fused is not None and fused.supports(gate_up):
            return fused.silu_mul(gate_up, out)
        gate, up = gate_up.chunk(2, dim=-1)  # (T, I) each
        return self.act(gate) * up if out is None else torch.mul(self.act(gate), up, out=out)
