"""Batched sampling, vLLM v1's order: the allowed-token mask and bad words, the
min_tokens mask, logit bias (``worker.sample.logits_processors``), the penalties, then
temperature, min-p, top-k and top-p, then one draw per row.

Every step runs as tensor ops over the whole batch (N, V); the only Python loops are
over rows that carry a seed (each draws from its own generator, as vLLM) and over rows
whose min_tokens still masks stop ids. Every other row's draw comes from one generator
for the whole batch, seeded once with the engine's global seed (``--seed``, vLLM's
default 0), so unseeded sampling repeats across runs that see the same requests in the
same order.

The draw inverts each row's distribution at one uniform u: the first token whose
cumulative probability (summed in float64) passes u times the row's total, which is
token i with probability probs[i] exactly (a masked token, of probability 0, never).
NOTE: vLLM's torch path races exponentials instead, ``argmax(probs / q)`` with q ~ Exp(1)
drawn for every entry of (N, V); torch draws those one element at a time, so that draw
costs many times the softmax, the cumulative sum and the search together
(docs/benchmarks.md, "Figures moved from docstrings (2026-12-07)"). vLLM's CPU backend
runs a fused C++ Gumbel-max kernel instead; its draws differ from these in value, not in
distribution.

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
    any_greedy: bool
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


class _Workspace:
    """The float64 buffer of the cumulative sums, kept across steps on CPU.

    NOTE: a fresh (N, V) float64 tensor a step is 2 MB at 8 rows of a 32,000-token
    vocabulary; glibc hands such blocks back to the kernel when freed (mmap, or a trim of
    the heap's top) and faults every page in again on the next step, which was most of the
    draw's time (docs/benchmarks.md, "Figures moved from docstrings (2026-12-07)"). (A
    cumsum with ``dtype=float64`` over float32 input takes a slower path still.) It keeps the largest batch's size: at most
    max_num_seqs x V x 8 bytes. CUDA's caching allocator keeps blocks already, so there
    each step allocates its own."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.float64)

    def take(self, shape: torch.Size, device: torch.device) -> torch.Tensor:
        n = shape[0] * shape[1]
        if device.type != "cpu":
            return torch.empty(shape, dtype=torch.float64, device=device)
        # NOTE: a buffer made under torch.inference_mode (the runner's step) cannot be written
        # outside it (a sampler called directly): then it is made again.
        if self.buffer.numel() < n or (self.buffer.is_inference() and not torch.is_inference_mode_enabled()):
            self.buffer = torch.empty(n, dtype=torch.float64)
        return self.buffer[:n].view(shape)


_CDF = _Workspace()


def _uniforms(n: int, device: torch.device, seeded: list[tuple[int, int]], generator: torch.Generator | None) -> torch.Tensor:
    """(n,) float64 uniforms in [0, 1): one from ``generator`` for every row (so the
    global stream advances by the batch size whatever the rows are), a seeded row's
    replaced by the first of its own generator's."""
    u = torch.rand(n, dtype=torch.float64, device=device, generator=generator)
    if seeded:
        gen = torch.Generator(device=device)
        for i, seed in seeded:
            gen.manual_seed(seed)
            u[i] = torch.rand((), dtype=torch.float64, device=device, generator=gen)
    return u


def draw(probs: torch.Tensor, seeded: list[tuple[int, int]], generator: torch.Generator | None) -> torch.Tensor:
    """(N, V) probabilities (each row's sum need not be 1) -> (N,) int64: token i of a row
    with probability probs[i] / the row's sum."""
    cdf = _CDF.take(probs.shape, probs.device)
    cdf.copy_(probs).cumsum_(dim=-1)  # (N, V), non-decreasing
    total = cdf[:, -1]
    target = _uniforms(probs.shape[0], probs.device, seeded, generator) * total
    # below the total even where u * total rounds up to it, so some index's sum exceeds it
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    # the first index whose cumulative sum exceeds the target: never a zero-probability
    # token, whose sum equals the one before it
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def sample(logits: torch.Tensor, bp: BatchParams) -> torch.Tensor:
    """(N, V) processed logits -> (N,) int64 token ids."""
    if bp.all_greedy:
        return logits.argmax(dim=-1)
    # NOTE: only for greedy rows: over a large vocabulary the argmax takes longer than the
    # softmax (docs/benchmarks.md, "Figures moved from docstrings (2026-12-07)").
    greedy_tokens = logits.argmax(dim=-1) if bp.any_greedy else None  # (N,)
    logits = logits / bp.temperature[:, None].to(logits.dtype)
    if bp.use_min_p:
        logits = apply_min_p(logits, bp.min_p)
    if bp.use_top_k or bp.use_top_p:
        logits = apply_top_k_top_p(logits, bp.top_k if bp.use_top_k else None, bp.top_p if bp.use_top_p else None)
    probs = logits.softmax(dim=-1, dtype=torch.float32)  # (N, V)
    drawn = draw(probs, bp.seeded, bp.generator)  # (N,)
    return drawn if greedy_tokens is None else torch.where(bp.greedy, greedy_tokens, drawn)


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
