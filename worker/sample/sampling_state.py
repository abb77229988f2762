"""Each live row's sampling parameters and penalty counts, for the batched sampler.

Indexed by the row's block-table row. Parameters are numpy columns (one entry per
table row, set when the row is added), so the rows sampled in a step gather theirs
with one fancy index per column, no loop over requests. Output-token counts for the
penalties and the prompt masks for the repetition penalty live on the device,
(max_num_seqs, V), allocated the first time a row needs them and updated in place each
step (the worker knows every request's tokens: contract rule 5). A row's logits
processors (allowed tokens, bad words, logit bias) are built once, when it is added
(``worker.sample.logits_processors``). A step in which no sampled row has parameters (greedy,
no logprobs: most benchmark traffic) is one argmax.

``seed`` is the engine's global seed (vLLM's ``--seed``): the generator of every row
without a seed of its own, seeded once here. Only sampling draws from it (not the
model, not greedy steps), so a fresh worker given the same seed and the same steps
draws the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from protocol.sampling_params import SamplingParams
from worker.sample.logits_processors import (
    RowLogitsParams,
    apply_allowed_and_bad_words,
    apply_logit_bias,
    row_logits_params,
)
from worker.sample.sampler import (
    BatchParams,
    Penalties,
    apply_penalties,
    mask_stop_tokens,
    sample,
    top_logprobs,
)

_U64 = 2**64 - 1


def mix_seed(seed: int, index: int) -> int:
    """The generator seed of a request's ``index``-th output token."""
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 1) & _U64


@dataclass(slots=True)
class RowLogprobs:
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def check_global_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _U64:
        raise ValueError(f"the global seed must be an integer in 0..2**64-1, got {seed!r}")
    return seed


class SamplingState:
    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device, seed: int = 0):
        self.vocab_size, self.device, self.max_num_seqs = vocab_size, device, max_num_seqs
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(check_global_seed(seed))
        n = max_num_seqs
        self.params: list[SamplingParams | None] = [None] * n
        self.special = np.zeros(n, dtype=bool)  # has SamplingParams at all
        self.greedy = np.ones(n, dtype=bool)
        self.temperature = np.ones(n, dtype=np.float32)
        self.top_k = np.zeros(n, dtype=np.int64)  # 0: every token
        self.top_p = np.ones(n, dtype=np.float32)
        self.min_p = np.zeros(n, dtype=np.float32)
        self.presence = np.zeros(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.repetition = np.ones(n, dtype=np.float32)
        self.penalised = np.zeros(n, dtype=bool)
        self.min_tokens = np.zeros(n, dtype=np.int64)
        self.logprobs = np.full(n, -1, dtype=np.int64)  # -1: none asked
        self.seeded = np.zeros(n, dtype=bool)
        # allowed_token_ids, bad words, logit_bias (worker.sample.logits_processors)
        self.processors: list[RowLogitsParams | None] = [None] * n
        self.has_processors = np.zeros(n, dtype=bool)
        self.output_counts: torch.Tensor | None = None  # (max_num_seqs, V) int32
        self.prompt_mask: torch.Tensor | None = None  # (max_num_seqs, V) bool

    def add(self, row: int, params: SamplingParams | None, token_ids: list[int], num_prompt: int) -> None:
        self.params[row] = params
        self.special[row] = params is not None
        p = params or _GREEDY
        self.greedy[row] = p.is_greedy
        self.temperature[row] = 1.0 if p.is_greedy else p.temperature
        self.top_k[row] = p.top_k if p.top_k > 0 else 0
        self.top_p[row], self.min_p[row] = p.top_p, p.min_p
        self.presence[row], self.frequency[row] = p.presence_penalty, p.frequency_penalty
        self.repetition[row] = p.repetition_penalty
        self.penalised[row] = p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
        self.min_tokens[row] = p.min_tokens
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.seeded[row] = p.seed is not None and not p.is_greedy
        self.processors[row] = row_logits_params(params, self.vocab_size, self.device)
        self.has_processors[row] = self.processors[row] is not None
        if not self.penalised[row]:
            return
        V, dev = self.vocab_size, self.device
        if self.output_counts is None:
            self.output_counts = torch.zeros((self.max_num_seqs, V), dtype=torch.int32, device=dev)
            self.prompt_mask = torch.zeros((self.max_num_seqs, V), dtype=torch.bool, device=dev)
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        self.output_counts[row] = torch.bincount(ids[num_prompt:], minlength=V).to(torch.int32)
        self.prompt_mask[row] = torch.bincount(ids[:num_prompt], minlength=V) > 0

    def remove(self, row: int) -> None:
        self.params[row] = None
        self.special[row] = False
        self.processors[row] = None
        self.has_processors[row] = False

    def _tensor(self, column: np.ndarray, idx: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(column[idx]).to(self.device)

    def sample(self, logits: torch.Tensor, rows: list[int], num_outputs: list[int],
               token_ids_of: Callable[[int], list[int]] | None = None) -> tuple[list[int], list[RowLogprobs | None]]:
        """logits (N, V) of the rows sampled this step; num_outputs[i]: tokens row i has
        sampled before this one; ``token_ids_of(i)``: row i's tokens (prompt and output),
        read only for rows with bad words. Returns the tokens and, per row, its logprobs
        or None."""
        idx = np.asarray(rows, dtype=np.int64)
        if not self.special[idx].any():
            return logits.argmax(dim=-1).tolist(), [None] * len(rows)
        dev, V = logits.device, logits.shape[1]
        raw = logits
        outs = np.asarray(num_outputs, dtype=np.int64)
        procs = np.flatnonzero(self.has_processors[idx])
        batch = None
        if len(procs):
            # NOTE: vLLM's order: allowed tokens, bad words, min_tokens, logit bias, then
            # the penalties, on float32 logits (a copy: raw stays the logprobs' source).
            batch = [self.processors[r] for r in rows]

            def output_token_ids(i: int) -> list[int]:
                n = int(outs[i])
                return token_ids_of(i)[-n:] if n and token_ids_of is not None else []

            logits = apply_allowed_and_bad_words(logits.to(torch.float32, copy=True), batch, output_token_ids)
        masked = np.flatnonzero(outs < self.min_tokens[idx])
        if len(masked):
            # NOTE: a loop over rows whose min_tokens is not yet reached (uncommon).
            pairs = [(int(i), t) for i in masked for t in self.params[rows[i]].stop_token_ids]
            logits = mask_stop_tokens(logits, [i for i, _ in pairs], [t for _, t in pairs])
        if batch is not None:
            logits = apply_logit_bias(logits, batch)
        pen = np.flatnonzero(self.penalised[idx])  # positions in the batch
        if len(pen):
            at, rows_t = torch.from_numpy(pen).to(dev), torch.from_numpy(idx[pen]).to(dev)
            sub = Penalties(
                presence=self._tensor(self.presence, idx[pen]), frequency=self._tensor(self.frequency, idx[pen]),
                repetition=self._tensor(self.repetition, idx[pen]),
                output_counts=self.output_counts[rows_t], prompt_mask=self.prompt_mask[rows_t],
            )
            logits = logits.index_copy(0, at, apply_penalties(logits[at], sub))
        greedy, top_k = self.greedy[idx], self.top_k[idx]
        sampling = ~greedy
        seeded = np.flatnonzero(self.seeded[idx])
        bp = BatchParams(
            temperature=self._tensor(self.temperature, idx), greedy=torch.from_numpy(greedy).to(dev),
            top_k=torch.from_numpy(np.where(top_k > 0, top_k, V)).to(dev),
            top_p=self._tensor(self.top_p, idx), min_p=self._tensor(self.min_p, idx),
            all_greedy=bool(greedy.all()), any_greedy=bool(greedy.any()),
            use_top_k=bool((sampling & (top_k > 0) & (top_k < V)).any()),
            use_top_p=bool((sampling & (self.top_p[idx] < 1)).any()),
            use_min_p=bool((sampling & (self.min_p[idx] > 0)).any()),
            seeded=[(int(i), mix_seed(self.params[rows[i]].seed, int(outs[i]))) for i in seeded],
            generator=self.generator,
        )
        tokens = sample(logits, bp)  # (N,)
        if len(pen):
            ones = torch.ones(len(pen), dtype=torch.int32, device=dev)
            self.output_counts.index_put_((rows_t, tokens[at]), ones, accumulate=True)
        out: list[RowLogprobs | None] = [None] * len(rows)
        k_of = self.logprobs[idx]
        want = np.flatnonzero(k_of >= 0)
        if len(want):
            at = torch.from_numpy(want).to(dev)
            lp, top_v, top_i = top_logprobs(raw[at], tokens[at], int(k_of[want].max()))
            lp, top_v, top_i = lp.tolist(), top_v.tolist(), top_i.tolist()
            for j, i in enumerate(want):
                n = int(k_of[i])
                out[i] = RowLogprobs(lp[j], top_i[j][:n], top_v[j][:n])
        return tokens.tolist(), out


_GREEDY = SamplingParams()
