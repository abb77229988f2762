"""Prompt logprobs (vLLM's ``prompt_logprobs``), computed chunk by chunk during prefill.

A row that asks for them, and has sampled nothing yet, is pending here from the plan
that adds it. Each step, the scheduled tokens of pending rows that precede another
prompt token get their logits (position i scores prompt token i+1) from the step's
hidden states; only those rows pay, and only for those positions. What a row gathered
is handed back once, in the step that samples its first token (vLLM returns them all
at the end of prefill too), and the row is done.

NOTE: a row resumed after a preemption carries its output tokens when it sampled
before: its prompt logprobs were sent then, so it is not pending again. A row
preempted mid-prefill is removed and re-added whole: it computes them afresh from
position 0 (it never reads the prefix cache: the scheduler's skip_reading_prefix_cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from protocol.prompt_logprobs import PromptLogprobs


@dataclass(slots=True)
class _Pending:
    k: int  # top-k asked
    num_prompt_tokens: int
    gathered: PromptLogprobs = field(default_factory=PromptLogprobs)


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

    def compute(self, compute_logits, hidden: torch.Tensor, chunks: list[PromptChunk], tokens_of) -> None:
        """hidden (T, H): the step's hidden states; ``tokens_of(seq_id)`` its tokens.
        Appends each chunk's positions that score a prompt token to its row."""
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
            spans.append((p, m))
        if not idx:
            return
        dev = hidden.device
        logits = compute_logits(hidden[torch.tensor(idx, dtype=torch.long, device=dev)])  # (M, V)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # (M, V)
        k = max(p.k for p, _ in spans)
        lp, ranks, top_v, top_i = gather_prompt_logprobs(logprobs, torch.tensor(targets, dtype=torch.long, device=dev), k)
        lp, ranks, top_v, top_i = lp.tolist(), ranks.tolist(), top_v.tolist(), top_i.tolist()
        at = 0
        for p, m in spans:
            g = p.gathered
            g.token_logprobs += lp[at : at + m]
            g.ranks += ranks[at : at + m]
            if p.k:
                g.top_token_ids += [row[: p.k] for row in top_i[at : at + m]]
                g.top_logprobs += [row[: p.k] for row in top_v[at : at + m]]
            at += m

    def take(self, seq_ids: list[int]) -> dict[int, PromptLogprobs]:
        """The finished prompts' logprobs of the rows that sample this step."""
        out = {}
        for sid in seq_ids:
            p = self.pending.pop(sid, None)
            if p is not None:
                out[sid] = p.gathered
        return out
