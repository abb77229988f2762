"""The logprobs of a request's prompt tokens (vLLM's ``prompt_logprobs``), as the worker
computes them during prefill and the client receives them with the first sampled token.

Columns over the prompt positions 1..P-1 (position 0 has no logprob: nothing precedes
it); entry i scores prompt token i+1 from the model's raw logits at token i, as vLLM's
default ``raw_logprobs``. ``ranks[i]``: that token's rank among the vocabulary (1 = most
likely; vLLM counts the tokens whose logprob is at least its own). ``top_*[i]``: the k
most likely tokens there, most likely first (empty lists when k is 0).
"""

from __future__ import annotations

import msgspec


class PromptLogprobs(msgspec.Struct, omit_defaults=True, gc=False):
    token_logprobs: list[float] = []
    ranks: list[int] = []
    top_token_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def __len__(self) -> int:
        return len(self.token_logprobs)
