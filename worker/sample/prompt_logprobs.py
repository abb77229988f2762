"""Prompt logprobs (vLLM's ``prompt_logprobs``), computed chunk by chunk during prefill.

A row that asks for them, and has sampled nothing yet, is pending here from the plan
that adds it. Each step, the scheduled tokens of pending rows that precede another
prompt token get their logits (position i scores prompt token i+1) from the step's
hidden states; only those rows pay, and only for those positions. Each step's result
carries what its chunks scored (so a frame is bounded by the step's token budget,
not by prompt lengths), and an entry, empty or not, for each pending row that samples
its first token: the scheduler joins a row's parts and hands them to the client with
that token, all at once as vLLM does. The row is then done.

NOTE: a row resumed after a preemption carries its output tokens when it sampled
before: its prompt logprobs were sent then, so it is not pending again. A row
preempted mid-prefill is removed and re-added whole: it scores its prompt afresh from
position 0 (it never reads the prefix cache: the scheduler's skip_reading_prefix_cache),
and the scheduler drops the parts it had.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.prompt_logprobs import PromptLogprobs


@dataclass(slots=True)
class _Pending:
    k: int  # top-k asked
    num_prompt_tokens: int


@dataclass(slots=True)
class PromptChunk:
    """One pending row's tokens in this step: where they start among the step's
    tokens, how many prompt tokens it had computed before, and how many it runs."""

    seq_id: int
    step_offset: int
    num_computed_tokens: int
    num_tokens: int


def gather_prompt_logprobs(logprobs: torch.Tensor, targets: torch.Tensor, k: int):
    """vLLM's ``Sampler.gather_logprobs``: from (M, V) logprobs, each target's logprob
    (M,), its rank (M,) -- the tokens whose logprob is at least its own -- and the
    top-k logprobs and ids (M, k)."""
    token_lp = logprobs.gather(1, targets[:, None])  # (M, 1)
    ranks = (logprobs >= token_lp).sum(dim=-1)  # (M,)
    top_v, top_i = logprobs.topk(k, dim=-1)  # (M, k)
    return token_lp[:, 0], ranks, top_v, top_i


class PromptLogprobsState:
    def __init__(self):
        self.pending: dict[int, _Pending] = {}

    def add(self, seq_id: int, k: int | None, token_ids: list[int], num_prompt_tokens: int) -> None:
        if k is not None and len(token_ids) == num_prompt_tokens:
            self.pending[seq_id] = _Pending(k, num_prompt_tokens)
        else:
            self.pending.pop(seq_id, None)

    def remove(self, seq_id: int) -> None:
        self.pending.pop(seq_id, None)

    def compute(self, compute_logits, hidden: torch.Tensor, chunks: list[PromptChunk], tokens_of) -> dict[int, PromptLogprobs]:
        """hidden (T, H): the step's hidden states; ``tokens_of(seq_id)`` its tokens.
        Each chunk's scored positions (those before another prompt token), by seq_id."""
        idx, targets, spans = [], [], []
        for ch in chunks:
            p = self.pending[ch.seq_id]
            # NOTE: the last prompt position scores the first output token, not a prompt token.
            m = min(ch.num_tokens, p.num_prompt_tokens - 1 - ch.num_computed_tokens)
            if m <= 0:
                continue
            c = ch.num_computed_tokens
            idx.extend(range(ch.step_offset, ch.step_offset + m))
            targets.extend(tokens_of(ch.seq_id)[c + 1 : c + 1 + m])
            spans.append((ch.seq_id, p.k, m))
        if not idx:
            return {}
        dev = hidden.device
        logits = compute_logits(hidden[torch.tensor(idx, dtype=torch.long, device=dev)])  # (M, V)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # (M, V)
        k_max = max(k for _, k, _ in spans)
        lp, ranks, top_v, top_i = gather_prompt_logprobs(logprobs, torch.tensor(targets, dtype=torch.long, device=dev), k_max)
        lp, ranks, top_v, top_i = lp.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
        parts, at = {}, 0
        for seq_id, k, m in spans:
            end = at + m
            top_ids = [row[:k] for row in top_i[at:end]] if k else []
            top_lps = [row[:k] for row in top_v[at:end]] if k else []
            parts[seq_id] = PromptLogprobs(lp[at:end], ranks[at:end], top_ids, top_lps)
            at = end
        return parts

    def finish(self, parts: dict[int, PromptLogprobs], sampled_seq_ids: list[int]) -> dict[int, PromptLogprobs]:
        """``parts`` with an entry for each pending row that samples its first token now
        (the scheduler's cue that its prompt is whole); those rows are done."""
        for sid in sampled_seq_ids:
            if self.pending.pop(sid, None) is not None:
                parts.setdefault(sid, PromptLogprobs())
        return parts
