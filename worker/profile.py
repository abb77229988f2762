"""The activation peak of one forward pass, measured on CUDA as vLLM profiles it: a
dummy batch of ``max_num_batched_tokens`` tokens through the model, the peak of the
allocator over what was allocated before, so the KV cache gets only what is left."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.models.decoder import DecoderModel


def _causal_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # One request of T tokens: the widest prefill a step can hold.
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True, enable_gqa=True
    )  # (1, nh, T, hd)
    return o[0].transpose(0, 1)


@torch.inference_mode()
def profile_activation_peak(model: DecoderModel, num_tokens: int) -> int:
    """Bytes above the current allocation that one forward of ``num_tokens`` needs."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    hidden = model.forward(ids, positions, _causal_attention)
    model.compute_logits(hidden[-256:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden
    torch.cuda.empty_cache()
    return max(0, peak)
