"""Speculative decoding's counters, as vLLM's SpecDecodingStats sums them.

Each step, every request that had drafts verified adds one draft, its draft tokens, the
ones accepted (a prefix of them: verification stops at the first mismatch) and, for each
position, whether the draft there was accepted. The process exports them as vLLM's
``vllm:spec_decode_*`` counters and logs them as its SpecDecodingLogging line.
"""

from __future__ import annotations


class SpecDecodingStats:
    __slots__ = ("num_spec_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")

    def __init__(self, num_spec_tokens: int):
        self.num_spec_tokens = num_spec_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"accepted {num_accepted_tokens} of {num_draft_tokens} drafts (at most {self.num_spec_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        for i in range(num_accepted_tokens):
            per_pos[i] += 1
