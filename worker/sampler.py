"""Batched sampling, vLLM v1's order: the allowed-token mask and bad words, the
min_tokens mask, logit bias (``worker.logits_processors``), the penalties, then
temperature, min-p, top-k and top-p, then one draw per row.

Every step runs as tensor ops over the whole batch (N, V); the only Python loops are
over rows that carry a seed (each draws its noise from its own generator, as vLLM) and
over rows whose min_tokens still masks stop ids. Every other row's noise comes from
one generator for the whole batch, seeded once with the engine's global seed
(``--seed``, vLLM's default 0), so unseeded sampling repeats across runs that see the
same requests in the same order. The draw is the exponential race
``argmax(probs / q)``, q ~ Exp(1), which picks token i with probability probs[i]
without a cumulative sum.

A seeded row's generator is seeded afresh for each output token from (seed, index of
the token), so its tokens depend on nothing else in the batch, and a request resumed
after preemption draws exactly what it would have drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = float("-inf")


@dataclass(slots=True)
class BatchParams:
    """Per-row parameters of the rows sampled this step, as (N,) device tensors."""

    temperature: torch.Tensor  # float; rows that are greedy hold 1.0
    greedy: torch.Tensor  # bool
    top_k: torch.Tensor  # int64; V where unset
    top_p: torch.Tensor  # float
    min_p: torch.Tensor  # float
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    # (row index, seed mixed with the output index) of each seeded, non-greedy row
    seeded: list[tuple[int, int]]
    # the unseeded rows' noise (the global seed's); None: torch's default generator
    generator: torch.Generator | None = None


@dataclass(slots=True)
class Penalties:
    presence: torch.Tensor  # (N,) float
    frequency: torch.Tensor  # (N,) float
    repetition: torch.Tensor  # (N,) float
    output_counts: torch.Tensor  # (N, V) int32: times each token was sampled
    prompt_mask: torch.Tensor | None  # (N, V) bool: in the prompt (for repetition)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's apply_penalties: repetition over prompt and output tokens (divides a
    positive logit, multiplies a negative one); frequency and presence over output."""
    counts = p.output_counts.to(logits.dtype)  # (N, V)
    seen = p.output_counts > 0  # (N, V)
    if p.prompt_mask is not None:
        seen_any = seen | p.prompt_mask
        rep = torch.where(seen_any, p.repetition[:, None].to(logits.dtype), 1.0)  # (N, V)
        logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - p.frequency[:, None].to(logits.dtype) * counts
    return logits - p.presence[:, None].to(logits.dtype) * seen.to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's apply_top_k_top_p: mask all but each row's k largest, then all but the
    smallest set whose probability reaches p (the most likely token always stays)."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)  # (N, V) ascending
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.shape[1] - k).clamp(min=0)[:, None])  # (N, 1)
        logits_sort = logits_sort.masked_fill(logits_sort < kth, _MASK)
    if p is not None:
        cum = logits_sort.softmax(dim=-1).cumsum(dim=-1)  # (N, V)
        drop = cum <= (1 - p[:, None])
        drop[:, -1] = False
        logits_sort = logits_sort.masked_fill(drop, _MASK)
    return logits_sort.scatter(-1, logits_idx, logits_sort)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is under min_p times the most likely one's."""
    probs = logits.softmax(dim=-1)  # (N, V)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, _MASK)


def _exponential_noise(probs: torch.Tensor, seeded: list[tuple[int, int]], generator: torch.Generator | None) -> torch.Tensor:
    q = torch.empty_like(probs).exponential_(generator=generator)  # (N, V)
    if seeded:
        gen = torch.Generator(device=probs.device)
        for i, seed in seeded:
            gen.manual_seed(seed)
            q[i].exponential_(generator=gen)
    return q


def sample(logits: torch.Tensor, bp: BatchParams) -> torch.Tensor:
    """(N, V) processed logits -> (N,) int64 token ids."""
    greedy_tokens = logits.argmax(dim=-1)  # (N,)
    if bp.all_greedy:
        return greedy_tokens
    logits = logits / bp.temperature[:, None].to(logits.dtype)
    if bp.use_min_p:
        logits = apply_min_p(logits, bp.min_p)
    if bp.use_top_k or bp.use_top_p:
        logits = apply_top_k_top_p(logits, bp.top_k if bp.use_top_k else None, bp.top_p if bp.use_top_p else None)
    probs = logits.softmax(dim=-1, dtype=torch.float32)  # (N, V)
    drawn = probs.div(_exponential_noise(probs, bp.seeded, bp.generator)).argmax(dim=-1)  # (N,)
    return torch.where(bp.greedy, greedy_tokens, drawn)


def mask_stop_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """Set logits[rows[j], token_ids[j]] to -inf (min_tokens not yet reached)."""
    if not rows:
        return logits
    logits = logits.clone()
    r = torch.tensor(rows, dtype=torch.long, device=logits.device)
    t = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    logits[r, t] = _MASK
    return logits


def top_logprobs(raw_logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the model's raw logits (vLLM's default raw_logprobs): the sampled tokens'
    logprobs (N,), and the top-k logprobs (N, k) and token ids (N, k)."""
    logprobs = raw_logits.float().log_softmax(dim=-1)  # (N, V)
    sampled = logprobs.gather(1, tokens[:, None])[:, 0]  # (N,)
    top_values, top_ids = logprobs.topk(k, dim=-1)  # (N, k) each; k may be 0
    return sampled, top_values, top_ids
