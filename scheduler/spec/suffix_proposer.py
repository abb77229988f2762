"""Suffix decoding drafts (vLLM's SuffixDecodingProposer over Arctic Inference's
``SuffixDecodingCache``), proposed where the tokens are.

Two kinds of suffix tree (scheduler/spec/suffix_tree.py), both of depth max_tree_depth:

* each running request's own, of its prompt and then of its verified tokens;
* one global tree of the responses of the last max_cached_requests requests (0: none), each
  grown as its request gains tokens (so running requests draft from each other too), taken
  out first in, first out when a request starts past the limit.

A draft matches each suffix of the request's last max_tree_depth tokens in both trees and
follows the most frequent continuation while its probability stays >= min_token_prob, at most
max_spec_factor * match length tokens and at most num_speculative_tokens (and never to
max_model_len); the better scored of the two trees' drafts wins, the request's own on a tie.

The lifecycle is vLLM's, whose model runner drives the cache: a request starts at its first
draft (its tree of its prompt; a slot in the global tree, evicting its own earlier response
if its id had one), feeds the tokens it gained before each draft, and stops when it leaves
the batch (finished, preempted, or left out of a step): its own tree goes, its response stays
cached. A request that comes back starts again, with its prompt and its tokens from then on
(vLLM's runner feeds only the tokens each step sampled).
"""

from __future__ import annotations

from itertools import count
from typing import Protocol

from scheduler.spec.suffix_tree import SuffixTree, f32


class Drafting(Protocol):
    """What the proposer reads of a request (scheduler.sched.request.Request)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    draft_index: SuffixDrafting | None


class SuffixDrafting:
    """One request's side of the cache: its own tree (None: stopped), how many of its tokens went
    in, and where its last start began feeding them (its tree: the prompt, then the tokens from there)."""

    __slots__ = ("tree", "num_fed", "start")

    def __init__(self, num_fed: int):
        self.tree: SuffixTree | None = None
        self.num_fed = self.start = num_fed


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_tree_depth: int, max_cached_requests: int,
                 max_spec_factor: float, min_token_prob: float, max_model_len: int):
        if num_speculative_tokens < 1 or max_tree_depth < 1 or max_cached_requests < 0:
            raise ValueError("need num_speculative_tokens, max_tree_depth >= 1 and max_cached_requests >= 0")
        self.k = num_speculative_tokens
        self.max_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_model_len = max_model_len
        # NOTE: Arctic takes the factor and the probability as float32; a match of m tokens
        # drafts at most int(float32(m * factor) + 1e-6) tokens.
        factor = f32(max_spec_factor)
        self.max_tokens_by_match = [max(0, int(f32(m * factor) + 1e-6)) for m in range(max_tree_depth + 1)]
        self.min_token_prob = f32(min_token_prob)
        self.global_tree = SuffixTree(max_tree_depth)
        self.cached: dict[str, int] = {}  # request_id -> its response's seq_id in global_tree, oldest first
        self._seq_ids = count()

    def propose(self, request: Drafting) -> list[int]:
        """Up to k draft tokens to follow ``request.all_token_ids`` (maybe none); feeds the trees first."""
        tokens = request.all_token_ids
        num_tokens = len(tokens)
        if num_tokens >= self.max_model_len:
            return []
        self.extend(request)
        context = tokens[max(0, num_tokens - self.max_depth):]
        max_spec_tokens = min(self.k, self.max_model_len - num_tokens - 1)
        state = request.draft_index
        # NOTE: the trees hold the tokens fed since the start as the context's tail (the own tree, after
        # the prompt: all of it unless the request started again): their suffixes' nodes are known.
        num_tail = num_tokens - state.start
        own_tail = num_tokens if state.start == request.num_prompt_tokens else num_tail
        own, own_score = state.tree.speculate(context, max_spec_tokens, self.max_tokens_by_match, self.min_token_prob, 0, own_tail)
        seq_id = self.cached.get(request.request_id)
        cached, cached_score = self.global_tree.speculate(context, max_spec_tokens, self.max_tokens_by_match, self.min_token_prob,
                                                          seq_id, 0 if seq_id is None else num_tail)
        return own if own_score >= cached_score else cached

    def start(self, request: Drafting) -> None:
        """The request's own tree of its prompt, and a slot for its response in the global tree."""
        state = request.draft_index
        if state is None:
            state = request.draft_index = SuffixDrafting(request.num_prompt_tokens)
        state.start = state.num_fed
        state.tree = SuffixTree(self.max_depth)
        state.tree.extend(0, request.all_token_ids[:request.num_prompt_tokens])
        if self.max_cached_requests == 0:
            return
        request_id = request.request_id
        if request_id in self.cached:
            self.evict(request_id)
        self.cached[request_id] = next(self._seq_ids)
        if len(self.cached) > self.max_cached_requests:
            self.evict(next(iter(self.cached)))

    def extend(self, request: Drafting) -> None:
        """The request's verified tokens since the last call go into its tree and its cached response
        (starting it first if it is not running in the cache)."""
        state = request.draft_index
        if state is None or state.tree is None:
            self.start(request)
            state = request.draft_index
        tokens = request.all_token_ids
        if state.num_fed >= len(tokens):
            return
        new = tokens[state.num_fed:]
        state.num_fed = len(tokens)
        state.tree.extend(0, new)
        seq_id = self.cached.get(request.request_id)
        if seq_id is not None:
            self.global_tree.extend(seq_id, new)

    def stop(self, request: Drafting) -> None:
        """The request left the batch: its own tree goes; its response stays cached."""
        state = request.draft_index
        if state is not None:
            state.tree = None

    def finish(self, request: Drafting) -> None:
        """The request ended: the tokens of its last step go in (as vLLM's runner fed them
        before the scheduler saw it end, unless it reached max_model_len), then it stops."""
        state = request.draft_index
        num_fed = request.num_prompt_tokens if state is None else state.num_fed
        if num_fed < len(request.all_token_ids) < self.max_model_len:
            self.extend(request)
        self.stop(request)

    def evict(self, request_id: str) -> None:
        """Take a cached response out of the global tree."""
        self.global_tree.remove(self.cached.pop(request_id))
