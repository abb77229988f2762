"""The same model with a plain contiguous KV cache and no pages: the ground truth.

Greedy outputs through the paged cache must equal ``reference_generate`` of the same
model (DESIGN.md, Worker). The attention here is deliberately written out by hand
(scores, causal mask, softmax) rather than sharing the paged path's SDPA calls, so
the two implementations check each other.
"""

from __future__ import annotations

import math

import torch

from worker.model import TinyModel


class ContiguousKVCache:
    """Per layer, the K and V of every token so far, concatenated in position order.

    Used as the model's AttentionFn: each call appends the chunk's k/v and attends the
    chunk's queries to the whole cache with a causal mask offset by the cached length.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # (L, kvh, hd) each
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def __len__(self) -> int:
        return 0 if self.keys[-1] is None else self.keys[-1].shape[0]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old_k, old_v = self.keys[layer], self.values[layer]
        keys = k if old_k is None else torch.cat((old_k, k))  # (L, kvh, hd)
        values = v if old_v is None else torch.cat((old_v, v))
        self.keys[layer], self.values[layer] = keys, values
        T, nh, hd = q.shape
        L, kvh = keys.shape[0], keys.shape[1]
        group = nh // kvh
        # NOTE: query head h reads kv head h // group (the repeat_interleave convention).
        kr = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (nh, L, hd)
        vr = values.repeat_interleave(group, dim=1).transpose(0, 1)  # (nh, L, hd)
        scores = q.transpose(0, 1) @ kr.transpose(1, 2) / math.sqrt(hd)  # (nh, T, L)
        query_pos = torch.arange(L - T, L, device=q.device)[:, None]  # (T, 1)
        key_pos = torch.arange(L, device=q.device)[None, :]  # (1, L)
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        return (probs @ vr).transpose(0, 1)  # (T, nh, hd)


def _forward_chunk(model: TinyModel, cache: ContiguousKVCache, token_ids: list[int]) -> torch.Tensor:
    start = len(cache)
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.device)  # (T,)
    positions = torch.arange(start, start + len(token_ids), device=model.device)  # (T,)
    return model.forward(ids, positions, cache)  # (T, H)


def reference_logits(model: TinyModel, token_ids: list[int]) -> torch.Tensor:
    """Logits (T, V) at every position of the full sequence, in one forward pass."""
    cache = ContiguousKVCache(model.config.num_layers)
    return model.compute_logits(_forward_chunk(model, cache, list(token_ids)))


def reference_generate(
    model: TinyModel,
    prompt_token_ids: list[int],
    max_tokens: int,
    ignore_eos: bool = True,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy generation: the output tokens (not the prompt), at most ``max_tokens``.

    Without ``ignore_eos`` generation stops after the EOS token (which is included,
    as vLLM includes it); ``eos_token_id`` defaults to the model's.
    """
    if not prompt_token_ids:
        raise ValueError("the prompt must have at least one token")
    eos = model.config.eos_token_id if eos_token_id is None else eos_token_id
    cache = ContiguousKVCache(model.config.num_layers)
    out: list[int] = []
    chunk = list(prompt_token_ids)
    with torch.inference_mode():
        while len(out) < max_tokens:
            hidden = _forward_chunk(model, cache, chunk)  # (T, H)
            token = int(model.compute_logits(hidden[-1:]).argmax(dim=-1)[0])
            out.append(token)
            if not ignore_eos and token == eos:
                break
            chunk = [token]
    return out
