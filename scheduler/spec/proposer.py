"""The drafter a --speculative-config asks for, and what the scheduler calls on it.

``propose`` drafts for a request that just sampled (and still runs); ``stop`` says a request
left the step's batch (preempted, or left out of a step by the token budget); ``finish`` says
it ended. N-gram drafting reads only the request's tokens and ignores the two; suffix decoding
keeps trees across steps and requests (scheduler/spec/suffix_proposer.py).
"""

from __future__ import annotations

from typing import Protocol

from protocol.speculative_config import SUFFIX, SpeculativeConfig
from scheduler.spec.ngram_proposer import NgramProposer
from scheduler.spec.suffix_proposer import SuffixProposer


class Proposer(Protocol):
    def propose(self, request) -> list[int]: ...

    def stop(self, request) -> None: ...

    def finish(self, request) -> None: ...


def make_proposer(speculative: SpeculativeConfig, max_model_len: int) -> Proposer:
    """The config's method's drafter."""
    if speculative.method == SUFFIX:
        return SuffixProposer(speculative.num_speculative_tokens, speculative.suffix_decoding_max_tree_depth,
                              speculative.suffix_decoding_max_cached_requests, speculative.suffix_decoding_max_spec_factor,
                              speculative.suffix_decoding_min_token_prob, max_model_len)
    return NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min, speculative.prompt_lookup_max, max_model_len)
