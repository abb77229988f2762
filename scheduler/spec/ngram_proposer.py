"""N-gram drafts (vLLM's NgramProposer, "prompt lookup"), proposed where the tokens are.

For a request of T tokens, the draft is what followed the earliest earlier occurrence of
its longest suffix of prompt_lookup_min..prompt_lookup_max tokens: at most k tokens, never
past its end nor past max_model_len. vLLM finds it with a KMP pass over the reversed
sequence each step (numba, ``_find_longest_matched_ngram_and_propose_tokens``); here each
request keeps an index of its n-grams' first starts, extended by the tokens it gained since
the last step, so a step's drafting costs a few dict lookups a request instead of a pass
over its whole sequence (the scheduler drafts between steps, on the step's path).

Same answer as vLLM's: the longest n with an occurrence of the n-suffix other than itself
(a shorter suffix occurs wherever a longer one does), and among those occurrences the one
that starts first.
"""

from __future__ import annotations

from typing import Protocol


class Drafting(Protocol):
    """What the proposer reads of a request (scheduler.sched.request.Request)."""

    all_token_ids: list[int]
    draft_index: NgramIndex | None


class NgramIndex:
    """One request's n-grams (tuples of prompt_lookup_min..max tokens) -> where each first starts."""

    __slots__ = ("first_start", "num_indexed")

    def __init__(self) -> None:
        self.first_start: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending within the first num_indexed tokens are in

    def extend(self, tokens: list[int], min_n: int, max_n: int) -> None:
        first_start = self.first_start
        setdefault = first_start.setdefault
        for end in range(self.num_indexed + 1, len(tokens) + 1):
            for n in range(min_n, min(max_n, end) + 1):
                setdefault(tuple(tokens[end - n : end]), end - n)
        self.num_indexed = len(tokens)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int, max_model_len: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}")
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be > 0, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, request: Drafting) -> list[int]:
        """Up to k draft tokens to follow ``request.all_token_ids`` (maybe none)."""
        tokens = request.all_token_ids
        total = len(tokens)
        k = min(self.k, self.max_model_len - total)
        if total < self.min_n or k <= 0:
            return []
        index = request.draft_index
        if index is None:
            index = request.draft_index = NgramIndex()
        if index.num_indexed < total:
            index.extend(tokens, self.min_n, self.max_n)
        first_start = index.first_start
        for n in range(min(self.max_n, total), self.min_n - 1, -1):
            start = first_start[tuple(tokens[total - n :])]
            if start < total - n:  # an occurrence other than the suffix itself
                begin = start + n
                return tokens[begin : begin + min(k, total - begin)]
        return []

    def stop(self, request: Drafting) -> None:
        """Nothing to drop: a request's index lives on the request (it grows from where it was)."""

    def finish(self, request: Drafting) -> None:
        """Nothing to keep: n-gram drafts read no other request's tokens."""
