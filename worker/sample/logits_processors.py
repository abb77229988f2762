"""vLLM v1's logits processors for ``allowed_token_ids``, ``bad_words`` and
``logit_bias``, batched over the rows of a step that have them.

vLLM's order (``Sampler.apply_logits_processors``), on float32 logits, for greedy
rows too: the allowed-token mask, then bad words, then min_tokens' stop-id mask, then
logit bias, then the penalties. Logprobs are taken before all of it (vLLM's default
``raw_logprobs``), so a biased token's logprob is the model's own.

Each row's part is built once, when its row is added (`RowLogitsParams`); a step
gathers the parts of its rows into one index per processor, so each processor is one
tensor op over the batch whatever the number of rows. Bad words are the exception that
vLLM has too: whether a word's last token is banned depends on the row's latest output
tokens, so it is a Python check per (row, word) of the rows that have bad words.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = float("-inf")


@dataclass(slots=True)
class RowLogitsParams:
    """One row's processors, on the device where they are tensors."""

    allowed: torch.Tensor | None  # (V,) bool: True where the token may be sampled
    bias_ids: torch.Tensor | None  # (B,) int64 token ids
    bias_values: torch.Tensor | None  # (B,) float32, each in [-100, 100]
    bad_words: list[list[int]]  # token-id sequences; their last token is banned after the rest


def row_logits_params(params, vocab_size: int, device: torch.device) -> RowLogitsParams | None:
    """A row's processors from its SamplingParams, None when it has none of them."""
    if params is None or not (params.allowed_token_ids or params.logit_bias or params.bad_words_token_ids):
        return None
    allowed = None
    if params.allowed_token_ids:
        allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        allowed[torch.tensor(params.allowed_token_ids, dtype=torch.long, device=device)] = True
    bias_ids = bias_values = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    return RowLogitsParams(allowed, bias_ids, bias_values, [list(w) for w in params.bad_words_token_ids])


def banned_by_bad_words(bad_words: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """vLLM's ``_apply_bad_words_single_batch``: the last token of every bad word whose
    other tokens are the row's latest output tokens (a one-token word always). Only
    output tokens count, never the prompt."""
    banned = []
    for word in bad_words:
        prefix = len(word) - 1
        if prefix > len(output_token_ids):
            continue
        if prefix == 0 or output_token_ids[-prefix:] == word[:prefix]:
            banned.append(word[-1])
    return banned


def apply_allowed_and_bad_words(logits: torch.Tensor, batch: list[RowLogitsParams | None],
                                output_token_ids) -> torch.Tensor:
    """logits (N, V) float32, ``batch[i]`` row i's processors or None, and
    ``output_token_ids(i)`` row i's output tokens so far: the allowed-token mask and
    the bad words applied, in place."""
    at = [i for i, p in enumerate(batch) if p is not None and p.allowed is not None]
    if at:
        at_t = torch.tensor(at, dtype=torch.long, device=logits.device)
        allowed = torch.stack([batch[i].allowed for i in at])  # (A, V)
        logits[at_t] = logits[at_t].masked_fill(~allowed, _MASK)
    rows, tokens = [], []
    for i, p in enumerate(batch):
        if p is not None and p.bad_words:
            banned = banned_by_bad_words(p.bad_words, output_token_ids(i))
            rows += [i] * len(banned)
            tokens += banned
    if rows:
        dev = logits.device
        logits[torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(tokens, dtype=torch.long, device=dev)] = _MASK
    return logits


def apply_logit_bias(logits: torch.Tensor, batch: list[RowLogitsParams | None]) -> torch.Tensor:
    """Add each row's biases to its logits (N, V), in place: one scatter for the batch."""
    at = [i for i, p in enumerate(batch) if p is not None and p.bias_ids is not None]
    if not at:
        return logits
    dev = logits.device
    rows = torch.cat([torch.full_like(batch[i].bias_ids, i) for i in at])  # (B,)
    ids = torch.cat([batch[i].bias_ids for i in at])  # (B,)
    values = torch.cat([batch[i].bias_values for i in at]).to(device=dev, dtype=logits.dtype)  # (B,)
    logits.index_put_((rows, ids), values, accumulate=True)
    return logits
